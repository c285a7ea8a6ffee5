"""mlx-guardian-notifier: tell a person when the guardian could not cope alone.

The plugin (``Notifier``) turns four hooks into notices; the outbox
(``guardian_notifier.outbox``) delivers them from a thread of its own, so no
hook ever waits on the network.
"""

from guardian_notifier.plugin import EVENTS, Notifier, NotifierSettings

__all__ = ["EVENTS", "Notifier", "NotifierSettings"]
