"""The endpoint's web config file (`--web.config.file`): TLS and basic auth, in the format of Prometheus'
exporter-toolkit (docs/web-configuration.md there), so one file serves node_exporter and gpuwarden alike:

    tls_server_config:
      cert_file: server.crt          # relative paths are relative to this file's folder
      key_file: server.key
      client_auth_type: RequireAndVerifyClientCert   # optional; NoClientCert by default
      client_ca_file: ca.crt                          # needed when client certificates are verified
      min_version: TLS12                               # optional: TLS10 .. TLS13
      max_version: TLS13
    basic_auth_users:
      prometheus: $2y$10$...         # bcrypt hash, e.g. `htpasswd -nBC 10 "" | tr -d ':\\n'`

A key this reader does not know (or does not support: cipher_suites, http_server_config, ...) is an error that
names it, never silently ignored: a TLS setting that is dropped would weaken what the operator asked for.
"""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from gpuwarden.agent.core.errors import ConfigError
from gpuwarden.agent.core.records import dataclass

if TYPE_CHECKING:  # ssl (and OpenSSL with it) is loaded only where a web config asks for TLS
    import ssl

MAX_FILE_BYTES = 1 << 20
_TLS_KEYS = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version"}
# The ssl module's names of each setting (resolved when a TLS context is built).
_CLIENT_AUTH = {"NoClientCert": "CERT_NONE", "VerifyClientCertIfGiven": "CERT_OPTIONAL",
                "RequireAndVerifyClientCert": "CERT_REQUIRED"}
_VERSIONS = {"TLS10": "TLSv1", "TLS11": "TLSv1_1", "TLS12": "TLSv1_2", "TLS13": "TLSv1_3"}
_BCRYPT_PREFIXES = ("$2a$", "$2b$", "$2y$")
# A hash to check a password against when the user is unknown, so that a wrong user takes as long as a wrong
# password (exporter-toolkit does the same). bcrypt of "unknown-user" at cost 10.
_DUMMY_HASH = b"$2b$10$knL4SIzBIY2a/J54tjyR0.K.ByrKYhBORy7RRpy6lPQ32u7KjVjDW"
_CACHE_SIZE = 64  # (user, password digest) -> verdict: a scrape every 15 s must not cost a bcrypt (~0.1 s) each


@dataclass(frozen=True)
class WebConfig:
    path: Path
    tls: ssl.SSLContext | None
    users: Mapping[str, bytes]  # user -> bcrypt hash
    watched: tuple[Path, ...]  # the files it was built from (re-read when one changes: certificate rotation)

    @property
    def auth(self) -> bool:
        return bool(self.users)


def load(path: Path) -> WebConfig:
    """Read and check the whole file (certificates loaded, hashes checked for shape); ConfigError names what is
    wrong and where."""
    # at use: yaml is +22 ms (python -X importtime, after the daemon's own imports) to a daemon given no web config
    import yaml

    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the web config: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigError(f"{path}: the web config is larger than {MAX_FILE_BYTES} bytes")
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 (byte {exc.start})") from None
    except (yaml.YAMLError, RecursionError) as exc:
        raise ConfigError(f"{path}: invalid YAML: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") \
            from None
    data = {} if data is None else data
    _mapping(path, "the web config", data)
    unknown = sorted(str(k) for k in data if k not in ("tls_server_config", "basic_auth_users"))
    if unknown:
        raise ConfigError(f"{path}: unknown or unsupported key '{unknown[0]}' (supported: tls_server_config, "
                          "basic_auth_users)")
    base = Path(path).parent
    tls, files = None, [Path(path)]
    tls_cfg = data.get("tls_server_config") or {}
    _mapping(path, "tls_server_config", tls_cfg)
    if tls_cfg:
        tls, tls_files = _tls_context(path, base, tls_cfg)
        files += tls_files
    users_cfg = data.get("basic_auth_users") or {}
    _mapping(path, "basic_auth_users", users_cfg)
    users: dict[str, bytes] = {}
    for user, hashed in users_cfg.items():
        if not isinstance(user, str) or not user or ":" in user:
            raise ConfigError(f"{path}: basic_auth_users: user {user!r} must be a non-empty string without ':'")
        if not isinstance(hashed, str) or not hashed.startswith(_BCRYPT_PREFIXES) or len(hashed) != 60:
            raise ConfigError(f"{path}: basic_auth_users.{user}: not a bcrypt hash ($2a$/$2b$/$2y$, 60 characters)")
        users[user] = hashed.encode("ascii", "replace")
    if users:
        # at use: +1.2 ms to a daemon without basic auth (python -X importtime); here, not at the first scrape, so
        # that a missing bcrypt fails the start
        import bcrypt  # noqa: F401
    return WebConfig(Path(path), tls, users, tuple(files))


def _mapping(path: Path, what: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: {what} must be a mapping, got {type(value).__name__}")


def _tls_context(path: Path, base: Path, cfg: Mapping[str, Any]) -> tuple[ssl.SSLContext, list[Path]]:
    unknown = sorted(str(k) for k in cfg if k not in _TLS_KEYS)
    if unknown:
        raise ConfigError(f"{path}: tls_server_config: unknown or unsupported key '{unknown[0]}' (supported: "
                          f"{', '.join(sorted(_TLS_KEYS))})")
    for key in cfg:
        if not isinstance(cfg[key], str):
            raise ConfigError(f"{path}: tls_server_config.{key} must be a string")
    if not cfg.get("cert_file") or not cfg.get("key_file"):
        raise ConfigError(f"{path}: tls_server_config needs both cert_file and key_file")
    import ssl  # at use: ssl (OpenSSL) is +8 ms to a daemon's start without TLS (python -X importtime)

    cert, key = base / cfg["cert_file"], base / cfg["key_file"]
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = _version(path, cfg, "min_version", "TLS12")
    ctx.maximum_version = _version(path, cfg, "max_version", "TLS13")
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{path}: tls_server_config: cannot load {cert} / {key}: {exc}") from None
    files = [cert, key]
    mode = cfg.get("client_auth_type", "NoClientCert")
    if mode not in _CLIENT_AUTH:
        raise ConfigError(f"{path}: tls_server_config.client_auth_type must be one of {', '.join(_CLIENT_AUTH)}")
    ctx.verify_mode = getattr(ssl, _CLIENT_AUTH[mode])
    if cfg.get("client_ca_file"):
        ca = base / cfg["client_ca_file"]
        try:
            ctx.load_verify_locations(cafile=ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"{path}: tls_server_config: cannot load client_ca_file {ca}: {exc}") from None
        files.append(ca)
    elif mode != "NoClientCert":
        raise ConfigError(f"{path}: tls_server_config: client_auth_type {mode} needs client_ca_file")
    return ctx, files


def _version(path: Path, cfg: Mapping[str, Any], key: str, default: str) -> ssl.TLSVersion:
    import ssl  # at use: +8 ms to a daemon's start without TLS (python -X importtime); loaded by _tls_context

    name = cfg.get(key, default)
    if name not in _VERSIONS:
        raise ConfigError(f"{path}: tls_server_config.{key} must be one of {', '.join(_VERSIONS)}")
    return getattr(ssl.TLSVersion, _VERSIONS[name])


class Watched:
    """The current web config: re-read when one of its files changes (looked at most once a second, on a new
    connection), so a renewed certificate or a changed password is taken without a restart. A file that no longer
    loads is logged and the last good config kept."""

    def __init__(self, path: Path, log: Any):
        self._path, self._log = path, log
        self._lock = threading.Lock()
        self.config = load(path)
        self._stamp = _stamp(self.config.watched)
        self._looked = time.monotonic()
        self._verdicts: OrderedDict[tuple[str, bytes], bool] = OrderedDict()

    def current(self) -> WebConfig:
        now = time.monotonic()
        with self._lock:
            if now - self._looked < 1.0:
                return self.config
            self._looked = now
            stamp = _stamp(self.config.watched)
            if stamp == self._stamp:
                return self.config
            self._stamp = stamp
        try:
            fresh = load(self._path)
        except ConfigError as exc:
            self._log.error("web config changed but does not load; keeping the last good one", error=str(exc))
            return self.config
        with self._lock:
            self.config, self._stamp = fresh, _stamp(fresh.watched)
            self._verdicts.clear()
        self._log.info("web config reloaded", path=str(self._path), tls=fresh.tls is not None, auth=fresh.auth)
        return fresh

    def authorized(self, config: WebConfig, user: str, password: str) -> bool:
        """Whether `user:password` matches; bcrypt runs in the caller's thread (it releases the GIL)."""
        # at use: +5 ms (python -X importtime) to a daemon without basic auth; with it, load() has imported both
        import hashlib

        import bcrypt  # at use: +1.2 ms (python -X importtime) to a daemon without basic auth

        hashed = config.users.get(user)
        key = (user, hashlib.sha256(password.encode("utf-8", "surrogateescape") + b"\0" + (hashed or b"")).digest())
        with self._lock:
            if key in self._verdicts:
                return self._verdicts[key]
        try:
            ok = bcrypt.checkpw(password.encode("utf-8", "surrogateescape"), hashed or _DUMMY_HASH)
            ok = ok and hashed is not None
        except ValueError:  # a hash bcrypt cannot read (shape checked at load; bcrypt's own rules are stricter)
            ok = False
        with self._lock:
            self._verdicts[key] = ok
            while len(self._verdicts) > _CACHE_SIZE:
                self._verdicts.popitem(last=False)
        return ok


def _stamp(files: tuple[Path, ...]) -> tuple[Any, ...]:
    out = []
    for f in files:
        try:
            st = os.stat(f)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)

