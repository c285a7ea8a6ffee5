"""API keys: the key file, and which key (if any) a request presents.

The file has one key a line, ``KEY`` or ``NAME:KEY``; ``KEY`` may be
``sha256:<64 hex digits>``, the SHA-256 of the key, so the file need hold no
secret (``printf %s "$KEY" | sha256sum``). ``#`` starts a comment, at the start
of a line or after whitespace. A key without a name is called ``key-N`` after
its line. Only names ever reach logs and metrics.

A presented key is hashed once and its digest compared with every key's in
constant time (``hmac.compare_digest``, no early exit): the time an answer
takes says nothing of which key, or which part of one, was close (vLLM checks
its keys the same way).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import structlog

from guardian.config.loading import read_still
from guardian.config.registry import ConfigError

log = structlog.get_logger("guardian.access")

HASHED_PREFIX = "sha256:"
# Names go into log lines and metric labels: one plain token.
KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")
HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}")
# A key shorter than this is a typo or a placeholder, not a secret.
MIN_KEY_CHARS = 8
# A name with a run this long of letters and digits mixed looks like a generated key.
SECRET_RUN_CHARS = 24
# Names one log line lists at most (a file of 200,000 keys wrote lines of 2 MB).
NAMES_LOGGED = 20
# The headers a key may come in: what the openai SDK sends, and the common alternative.
AUTHORIZATION = "Authorization"
API_KEY_HEADER = "X-Api-Key"


class KeyFileError(ConfigError):
    """The key file cannot be used; the message names the line, never the key."""


@dataclass(frozen=True)
class ApiKey:
    name: str
    digest: bytes  # SHA-256 of the key's UTF-8 bytes
    in_clear: bool = True  # written as the key itself, not as sha256:<hex>


def digest_of(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def parse_key_file(text: str, source: str = "the key file") -> tuple[ApiKey, ...]:
    """Every key in the file's text; KeyFileError for a line that is not one."""
    keys, errors = parse_key_lines(text, source)
    if errors:
        raise errors[0]
    return keys


def parse_key_lines(text: str, source: str = "the key file") -> tuple[tuple[ApiKey, ...], list[KeyFileError]]:
    """The keys of the lines that are keys, and an error for each line that is not one."""
    keys: list[ApiKey] = []
    errors: list[KeyFileError] = []
    names: set[str] = set()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = strip_comment(raw).strip()
        if not line:
            continue
        where = f"{source}, line {number}"
        name, key = split_name(line, default=f"key-{number}")
        try:
            if not KEY_NAME.fullmatch(name):
                raise KeyFileError(f"{where}: a key's name is letters, digits and ._@- (at most 64)")
            if written_backwards(name, key):
                raise KeyFileError(f"{where}: its name looks like a key (written KEY:NAME, or a key holding "
                                   "a ':' written alone?), and names are logged: NAME:KEY, the name first")
            if name in names:
                raise KeyFileError(f"{where}: the name {name!r} is used twice")
            keys.append(ApiKey(name, key_digest(key, where), in_clear=not is_hashed(key)))
        except KeyFileError as e:
            errors.append(e)
        names.add(name)
    return tuple(keys), errors


def warn_if_others_may_read(path: Path, keys: tuple[ApiKey, ...]) -> None:
    """Log ``api_key_file_readable_by_others`` for a file of keys in the clear that users
    other than its owner may read (as ssh does for a private key; not refused: the
    operator may mean it, a group of admins, say)."""
    in_clear = [key.name for key in keys if key.in_clear]
    try:
        mode = path.stat().st_mode
    except OSError:
        return
    if in_clear and mode & 0o044:
        log.warning("api_key_file_readable_by_others", file=str(path), mode=oct(mode & 0o777),
                    keys_in_clear=in_clear,
                    hint=f"chmod 600 {path}, or write each key as sha256:<hex> "
                         "(its SHA-256, which need not be kept secret)")


def strip_comment(line: str) -> str:
    """The line without its comment: from a "#" that starts it or follows whitespace."""
    if line.lstrip().startswith("#"):
        return ""
    match = re.search(r"\s#", line)
    return line[:match.start()] if match else line


def split_name(line: str, default: str) -> tuple[str, str]:
    """(name, key) of ``NAME:KEY``, ``KEY`` or ``sha256:HEX`` (which names no one)."""
    if is_hashed(line) or ":" not in line:
        return default, line
    name, key = line.split(":", 1)
    return name.strip(), key.strip()


def is_hashed(text: str) -> bool:
    """Whether ``text`` is written as ``sha256:<hex>``, in any case: ``SHA256:<hex>`` was read
    as a key in the clear (its digest itself the key), so a hash published as no secret
    worked as one."""
    return text[:len(HASHED_PREFIX)].lower() == HASHED_PREFIX


def written_backwards(name: str, key: str) -> bool:
    """Whether a line's name is likely a key, which would reach every log line and metric
    that names it: written ``KEY:NAME``, or a key holding a ``:`` written alone (the part
    before it taken for a name). A name with a key's ``sk-`` prefix always; one with a
    long run of letters and digits mixed (an ObjectId is a name) only where its key does
    not look like a key itself."""
    if name.lower().startswith(("sk-", "sk_")):
        return True
    return has_a_generated_run(name) and not is_hashed(key) and not (
        key.lower().startswith(("sk-", "sk_")) or has_a_generated_run(key))


def has_a_generated_run(text: str) -> bool:
    """A run of SECRET_RUN_CHARS letters and digits, mixed, as generated keys hold."""
    return any(len(run) >= SECRET_RUN_CHARS and not run.isalpha() and not run.isdigit()
               for run in re.findall(r"[A-Za-z0-9]+", text))


def key_digest(key: str, where: str) -> bytes:
    if is_hashed(key):
        hexdigest = key[len(HASHED_PREFIX):]
        if not HEX_DIGEST.fullmatch(hexdigest):
            raise KeyFileError(f"{where}: sha256: must be followed by 64 hex digits")
        return bytes.fromhex(hexdigest)
    if len(key) < MIN_KEY_CHARS or any(c.isspace() or not c.isprintable() for c in key):
        raise KeyFileError(f"{where}: a key is at least {MIN_KEY_CHARS} printable characters, no spaces")
    return digest_of(key.encode())


def presented_key(headers) -> tuple[Optional[bytes], Optional[str]]:
    """(the key a request presents, or None; what is wrong with its headers, or None).

    ``headers``: an ``email.message.Message`` as http.server parses them (every
    value decoded as latin-1, so encoding it back gives the client's bytes).
    """
    authorization = headers.get_all(AUTHORIZATION) or []
    api_key = headers.get_all(API_KEY_HEADER) or []
    if len(authorization) + len(api_key) > 1:
        return None, "send the API key once, in one header"
    if authorization:
        scheme, _, credentials = authorization[0].strip().partition(" ")
        if scheme.lower() != "bearer" or not credentials.strip():
            return None, "the Authorization header must be 'Bearer <API key>'"
        return encode(credentials.strip()), None
    if api_key:
        return (encode(api_key[0].strip()), None) if api_key[0].strip() else (None, "the X-Api-Key header is empty")
    return None, None


def encode(value: str) -> bytes:
    return value.encode("latin-1", "replace")


class KeyRing:
    """The keys in force, read from the key file and again whenever it changes.

    A file that cannot be read or parsed adds no key (logged as
    ``api_keys_reload_failed``), but its removals apply: of the keys in force,
    only those still on one of its good lines stay (a stolen key deleted in the
    same save as a typo made elsewhere stayed in force; a file deleted revokes
    every key). One being written in place is read once its writer has closed
    it (guardian.config.live, where the kernel says so: Linux) and it has held
    still for half a second (guardian.config.loading.read_still), so a half-saved
    file lets no key cut short in, nor an emptied one revokes every key.
    """

    def __init__(self, path: Optional[str]):
        self.path = Path(path) if path else None
        self._keys: tuple[ApiKey, ...] = ()
        self._lock = threading.Lock()
        self._watcher = None
        self.loads = 0
        self.last_failure: Optional[str] = None
        self.read_sha256: Optional[str] = None  # the file's bytes as last read in full
        self._refused_sha256: Optional[str] = None  # the bytes of the version last refused
        if self.path is not None:
            self._keys = self._read()  # at start, a bad file is an error (KeyFileError)
            self.loads = 1

    @property
    def configured(self) -> bool:
        """Whether keys are required: a key file is given (even one emptied since)."""
        return self.path is not None

    @property
    def names(self) -> list[str]:
        return [key.name for key in self._keys]

    def identify(self, presented: bytes) -> Optional[str]:
        """The name of the key ``presented`` is, or None; every key is compared."""
        digest = digest_of(presented)
        found = None
        for key in self._keys:
            if hmac.compare_digest(digest, key.digest):
                found = key.name
        return found

    def _read(self) -> tuple[ApiKey, ...]:
        keys, errors, _ = self._read_lines()
        if errors:
            raise errors[0]
        return keys

    def _read_lines(self, still: bool = False) -> tuple[tuple[ApiKey, ...], list[KeyFileError], Optional[str]]:
        """The file's good keys, what is wrong with it (a file that cannot be read has none),
        and its bytes' SHA-256 (None: none were read). ``still``: read again while the server
        runs, so only a version no writer is changing (guardian.config.loading.read_still)."""
        try:
            raw = read_still(self.path)[0] if still else self.path.read_bytes()
        except OSError as e:
            return (), [KeyFileError(f"{self.path}: cannot be read: {type(e).__name__}: {e}")], None
        sha256 = hashlib.sha256(raw).hexdigest()
        try:
            text = raw.decode("utf-8-sig")  # an editor's byte order mark is no part of a name
        except UnicodeDecodeError as e:
            return (), [KeyFileError(f"{self.path}: cannot be read: {type(e).__name__}: {e}")], sha256
        keys, errors = parse_key_lines(text, str(self.path))
        if errors:
            return keys, errors, sha256
        self.read_sha256 = sha256
        warn_if_others_may_read(self.path, keys)
        if not keys:
            log.warning("api_key_file_empty", file=str(self.path),
                        why="no key in the file: every request that needs one is refused (401) "
                            "until a key is added (the file is followed)")
        return keys, [], sha256

    def reload(self, reason: str = "sighup") -> bool:
        """Read the file again; whether the new set is in force."""
        if self.path is None:
            return False
        with self._lock:
            before = self.read_sha256
            keys, errors, seen = self._read_lines(still=True)
            if errors and reason == "file_changed" and seen is not None and seen == self._refused_sha256:
                # Another event of one broken save (a rename and a late event, or the watch's
                # poll): refused, its keys revoked and said once.
                return False
            if errors:
                self._refused_sha256 = seen
                still_there = {key.digest for key in keys}
                revoked = [key.name for key in self._keys if key.digest not in still_there]
                self._keys = tuple(key for key in self._keys if key.digest in still_there)
                self.last_failure = str(errors[0])
                log.error("api_keys_reload_failed", reason=reason, error_message=str(errors[0]),
                          bad_lines=len(errors), keys_in_force=len(self._keys), revoked=names_logged(revoked),
                          why="no key is added from a file with a bad line; a key no longer in it is revoked")
                return False
            if reason == "file_changed" and self.read_sha256 == before and self.last_failure is None:
                # Another event of one save, a change of mode (read, so warned of if others may
                # read it now), or FSEvents' events from before the watch began: the set in force.
                return True
            old = set(self.names)
            self._keys = keys
            self.loads += 1
            self.last_failure = None
            self._refused_sha256 = None
        new = set(self.names)
        log.info("api_keys_reloaded", reason=reason, keys=len(keys), added=names_logged(new - old),
                 removed=names_logged(old - new))
        return True

    def request_reload(self, reason: str = "sighup") -> None:
        """Read the file again soon (SIGHUP's, run on the main thread): on the watch's thread, which
        waits for a writer that has the file open to close it, as it does for a save (where
        the kernel says so: Linux)."""
        if self.path is None:
            return
        if self._watcher is None:
            threading.Thread(target=self.reload, args=(reason,), name="keys-reload", daemon=True).start()
        else:
            self._watcher.kick(reason)

    def follow(self) -> None:
        """Reload on every save of the file (SIGHUP is the caller's to route to ``request_reload``)."""
        if self.path is None or self._watcher is not None:
            return
        from guardian.config.live import ConfigFileWatcher

        self._watcher = ConfigFileWatcher(self.path, self.reload)
        self._watcher.start(read_sha256=self.read_sha256)

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()

    def status(self) -> dict:
        return {"key_file": str(self.path) if self.path else None, "keys": len(self._keys),
                "names": self.names, "loads": self.loads, "last_failure": self.last_failure}


def names_logged(names) -> list[str]:
    """Key names as one log line lists them: sorted, at most NAMES_LOGGED, then how many more."""
    names = sorted(names)
    if len(names) <= NAMES_LOGGED:
        return names
    return [*names[:NAMES_LOGGED], f"(and {len(names) - NAMES_LOGGED} more)"]
