"""HTTP/1.1 as the metrics endpoint speaks it (agent/daemon/http_endpoint.py): a request head parsed (a request,
or the error response that ends its connection), a response's bytes. No request body is ever read.
"""
from __future__ import annotations

from gpuwarden.agent.core.records import dataclass


@dataclass
class Request:
    method: str
    target: str
    version: str
    headers: dict[str, str]
    keep_alive: bool


def parse_head(head: bytes) -> Request | bytes:
    lines = head.decode("latin-1").split("\n")
    parts = lines[0].rstrip("\r").split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[1]:
        return simple(400, "Bad Request", "malformed request line\n", keep=False)
    method, target, version = parts
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        if version.startswith("HTTP/"):
            return simple(505, "HTTP Version Not Supported", "HTTP/1.0 and HTTP/1.1 only\n", keep=False)
        return simple(400, "Bad Request", "malformed request line\n", keep=False)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.rstrip("\r").partition(":")
        if not sep or not name or name != name.strip() or " " in name or "\t" in name:
            return simple(400, "Bad Request", "malformed header line\n", keep=False)
        key, value = name.lower(), value.strip(" \t")
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep = "close" not in tokens if version == "HTTP/1.1" else "keep-alive" in tokens
    length = headers.get("content-length", "0").strip()
    if not length.isascii() or not length.isdigit():
        return simple(400, "Bad Request", "malformed Content-Length\n", keep=False)
    if "transfer-encoding" in headers or int(length.lstrip("0") or "0") > 0:
        keep = False  # a body is never read: the next request's start in the stream is unknown
    return Request(method, target, version, headers, keep)


def response(code: int, reason: str, body: bytes, content_type: str, keep: bool, extra: tuple[str, ...] = (),
              head_only: bool = False) -> bytes:
    lines = [f"HTTP/1.1 {code} {reason}", f"Content-Type: {content_type}", f"Content-Length: {len(body)}", *extra,
             "Connection: keep-alive" if keep else "Connection: close"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head_only else body)


def simple(code: int, reason: str, text: str, keep: bool, extra: tuple[str, ...] = (),
            head_only: bool = False) -> bytes:
    return response(code, reason, text.encode(), "text/plain; charset=utf-8", keep, extra, head_only)
