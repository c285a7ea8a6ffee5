"""The engine: stock's generation loop, supervised, and the one lifecycle it moves through."""
