"""Request bodies sent with a ``Content-Encoding``: decoded here, within the body limit.

aiohttp's own decoding (``auto_decompress``) is off for the gateway (``create_app``): it chose the
decoder while parsing the head, before any middleware, so a coding it could not decode (``br`` without
Brotli) was an ERROR log with a traceback per request and a plain-text 400, and a coding it did not know
(``foo``) was read as if the body were plain. Here ``identity``, ``gzip`` (``x-gzip``) and ``deflate``
are decoded once the request is authorized; any other coding (or a list of them) is a 415 naming the
header, before the body is read. The decoded body is bounded by ``max_body_bytes`` as a plain body is
(413: a small gzip that inflates past the limit is never held whole), and one that does not decode is a
400 (``invalid_body``).
"""

from __future__ import annotations

import zlib

from aiohttp import hdrs, web

from gateway.errors import APIError, InvalidRequest, PayloadTooLarge

HEADER = hdrs.CONTENT_ENCODING
_GZIP_WBITS = 16 + zlib.MAX_WBITS
_CODING_TO_WBITS = {"gzip": _GZIP_WBITS, "x-gzip": _GZIP_WBITS, "deflate": zlib.MAX_WBITS}
MAX_GZIP_MEMBERS = 1000  # clients send one; a few more are legal (RFC 1952), a hundred thousand an attack
_FIRST_CHUNK_BYTES = 256  # a member's compressed bytes are fed in chunks of 256 bytes, doubling
_MAX_CHUNK_BYTES = 1 << 20


class UnsupportedMediaType(APIError):
    status = 415
    code = "unsupported_content_encoding"


class UnsupportedTransferCoding(APIError):
    status = 501
    code = "unsupported_transfer_encoding"


def check_transfer_coding(request: web.BaseRequest) -> None:
    """A ``Transfer-Encoding`` other than ``chunked`` alone is a 501 (RFC 9112 §6.1: a transfer coding
    the server does not understand). aiohttp frames any list ending in ``chunked`` (``gzip, chunked``)
    as chunked and leaves the other codings undone: the body would be read still encoded."""
    codings = [
        coding.strip().lower()
        for value in request.headers.getall(hdrs.TRANSFER_ENCODING, ())
        for coding in value.split(",")
    ]
    if codings and codings != ["chunked"]:
        raise UnsupportedTransferCoding(
            f"unsupported 'Transfer-Encoding: {', '.join(codings)[:100]}': only 'chunked' is",
            param=hdrs.TRANSFER_ENCODING,
        )


def content_coding(request: web.BaseRequest) -> str | None:
    """The body's coding (``gzip``, ``x-gzip``, ``deflate``), None for a plain body; raises
    UnsupportedMediaType (415) for any other."""
    given = request.headers.get(HEADER)
    if given is None:
        return None
    coding = given.strip().lower()
    if coding in ("", "identity"):
        return None
    if coding in _CODING_TO_WBITS and len(request.headers.getall(HEADER)) == 1:
        return coding
    raise UnsupportedMediaType(
        f"unsupported '{HEADER}: {given[:100]}': send the body as is, or with 'gzip' or 'deflate'",
        param=HEADER,
    )


def decode_body(body: bytes, coding: str, max_bytes: int) -> bytes:
    """``body`` decoded from ``coding``: at most ``max_bytes`` (else PayloadTooLarge, without inflating
    more than one byte past the limit), a 400 when it does not decode. A gzip body may hold several
    members (RFC 1952), at most ``MAX_GZIP_MEMBERS`` (400 past them); a ``deflate`` body may be raw
    DEFLATE without the zlib header, as some clients send it.

    Linear in the body's size: each member is fed from a view of the body in chunks that start small
    and double (``unused_data``, a copy of what follows a member's end, is then at most twice that
    member's size). Fed the rest of the body at once, 2 MiB of empty 20-byte members copied the rest
    once per member and held the event loop for seconds."""
    wbits = _CODING_TO_WBITS[coding]
    if wbits == zlib.MAX_WBITS and body and body[0] & 0x0F != 8:  # no zlib header: raw DEFLATE
        wbits = -zlib.MAX_WBITS
    view = memoryview(body)
    parts: list[bytes] = []
    size = start = num_members = 0
    try:
        while True:
            num_members += 1
            if num_members > MAX_GZIP_MEMBERS:
                raise InvalidRequest(
                    f"the request body could not be read: more than {MAX_GZIP_MEMBERS} {coding} members",
                    code="invalid_body",
                )
            decoder = zlib.decompressobj(wbits)
            start, size = _inflate_member(decoder, view, start, parts, size, max_bytes)
            if not decoder.eof:
                raise InvalidRequest(
                    f"the request body could not be read: its {coding} data ends early", code="invalid_body"
                )
            if start == len(view) or wbits != _GZIP_WBITS:
                break
    except zlib.error as exc:
        raise InvalidRequest(
            f"the request body could not be read: it is not valid {coding} data ({exc})", code="invalid_body"
        ) from None
    if start < len(view):
        raise InvalidRequest(
            f"the request body could not be read: data after its {coding} stream", code="invalid_body"
        )
    return b"".join(parts)


def _inflate_member(
    decoder: zlib._Decompress, view: memoryview, start: int, parts: list[bytes], size: int, max_bytes: int
) -> tuple[int, int]:
    """Feed ``decoder`` from ``view[start:]`` until its stream ends or the body does, appending what it
    inflates to ``parts``. Returns where the next member starts and the decoded size so far."""
    chunk_bytes = _FIRST_CHUNK_BYTES
    while start < len(view) and not decoder.eof:
        chunk = view[start : start + chunk_bytes]
        part = decoder.decompress(chunk, max_bytes + 1 - size)
        size += len(part)
        if size > max_bytes:
            raise PayloadTooLarge(f"request body too large (limit {max_bytes} bytes, decoded)")
        parts.append(part)
        # A chunk is consumed whole unless the stream ended in it (unused_data: the next member's
        # bytes). The output limit cannot leave input behind: reaching it is the 413 above.
        start += len(chunk) - len(decoder.unused_data)
        chunk_bytes = min(chunk_bytes * 2, _MAX_CHUNK_BYTES)
    return start, size
