"""What a frontend's KV cache holds, as both its publisher (the frontend's block manager) and its
reader (the router) compute and exchange it: the chain digest of a full block, the blocks of a
prompt that can be reused, and the page of events `GET /kv/events` answers (docs/design/kv-blocks.md,
"Routing by blocks").

A block's digest is blake2b over its parent's digest, its token ids and a salt (the model, and
anything else that changes its KV): the chain identifies the whole prefix, and a keyed,
collision-resistant hash means a prompt cannot be crafted to match another's blocks.

A page is either the events after the reader's sequence number (stored, removed, all cleared), or,
when the reader's number is unknown (a new reader, a restarted frontend: another epoch, or events
it missed that the bounded log no longer holds), a snapshot: every block held now.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"


def block_digest(parent: bytes, tokens: Sequence[int], salt: bytes) -> bytes:
    """The chain digest of a full block of `tokens` after the block whose digest is `parent`."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(array("q", tokens).tobytes())
    h.update(salt)
    return h.digest()


def reusable_blocks(prompt_tokens: int, block_tokens: int) -> int:
    """How many leading full blocks of a prompt may come from the cache: those of prompt[:-1] (the
    last prompt token is always computed: the last stage samples from it)."""
    return max(0, prompt_tokens - 1) // block_tokens


def prompt_digests(prompt: Sequence[int], salt: bytes, block_tokens: int, limit: int) -> list[bytes]:
    """The chain digests of a prompt's reusable blocks (at most `limit` of them)."""
    digests: list[bytes] = []
    parent = b""
    for i in range(min(reusable_blocks(len(prompt), block_tokens), limit)):
        parent = block_digest(parent, prompt[i * block_tokens:(i + 1) * block_tokens], salt)
        digests.append(parent)
    return digests


Event = tuple[str, bytes, bytes]  # (STORED, digest, parent) | (REMOVED, digest, b"") | (CLEARED, b"", b"")


@dataclass(frozen=True)
class KvEventPage:
    """One answer of GET /kv/events: the publisher's identity (`epoch`: new at every start), its last
    sequence number, the digests' parameters and the tokenizer its prompts are tokenized with (the
    model directory or hub id), then a snapshot (`blocks`) or the events after the asked number."""

    epoch: str
    seq: int
    block_tokens: int
    salt: bytes
    tokenizer: str = ""
    snapshot: bool = False
    blocks: list[bytes] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"epoch": self.epoch, "seq": self.seq, "block_tokens": self.block_tokens,
                                "salt": self.salt.hex(), "tokenizer": self.tokenizer, "snapshot": self.snapshot}
        if self.snapshot:
            body["blocks"] = [digest.hex() for digest in self.blocks]
        else:
            body["events"] = [[kind, digest.hex(), parent.hex()] if kind == STORED else
                              [kind, digest.hex()] if kind == REMOVED else [kind]
                              for kind, digest, parent in self.events]
        return body

    @classmethod
    def from_json(cls, body: Any) -> KvEventPage:
        """The page of a JSON body, or ValueError saying what is wrong with it."""
        try:
            if not isinstance(body, Mapping):
                raise TypeError("not an object")
            snapshot = bool(body["snapshot"])
            events: list[Event] = []
            for item in () if snapshot else body["events"]:
                kind = item[0]
                if kind == STORED:
                    events.append((STORED, bytes.fromhex(item[1]), bytes.fromhex(item[2])))
                elif kind == REMOVED:
                    events.append((REMOVED, bytes.fromhex(item[1]), b""))
                elif kind == CLEARED:
                    events.append((CLEARED, b"", b""))
                else:
                    raise ValueError(f"unknown event {kind!r}")
            return cls(epoch=str(body["epoch"]), seq=int(body["seq"]), block_tokens=int(body["block_tokens"]),
                       salt=bytes.fromhex(body["salt"]), tokenizer=str(body.get("tokenizer") or ""),
                       snapshot=snapshot, events=events,
                       blocks=[bytes.fromhex(d) for d in body["blocks"]] if snapshot else [])
        except (KeyError, IndexError, TypeError, ValueError) as err:
            raise ValueError(f"not a KV event page: {err}") from None
