"""The replicas' tokenizer, fetched from one of them when the router cannot read the source their KV
events name (a model from the hub or a volume only the frontend pods mount): the files a frontend
serves at GET /kv/tokenizer (frontend/openai/utility/service_routes.py: an allow-listed few, never
weights or code) downloaded once into a temporary folder, which the router's tokenizer loads from as
a local folder (no hub access: safe under HF_HUB_OFFLINE).

The router's requests carry the API key the frontends check (api_key_headers): the same variable,
API_KEY_ENV, from the same Secret on Kubernetes.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import httpx

from inferencemesh.config import API_KEY_ENV

log = logging.getLogger("inferencemesh.router")

TOKENIZER_PATH = "/kv/tokenizer"
MAX_TOKENIZER_BYTES = 256 * 1024 * 1024  # what the router downloads at most (the frontend serves half)


def api_key_headers() -> dict[str, str]:
    """The Authorization header of the router's own requests to the frontends (their /kv/* routes
    are authenticated), from API_KEY_ENV; none where it is unset or empty."""
    key = os.environ.get(API_KEY_ENV, "")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _plain(name: str) -> bool:
    """A file name the router writes into its folder: no path, no hidden file."""
    return bool(name) and "/" not in name and "\\" not in name and not name.startswith(".")


async def download(client: httpx.AsyncClient, url: str, folder: Path) -> None:
    """The tokenizer files of the frontend at `url` into `folder` (raises httpx's errors, or
    ValueError for a listing that is not one or exceeds MAX_TOKENIZER_BYTES)."""
    response = await client.get(url + TOKENIZER_PATH)
    response.raise_for_status()
    listing = response.json()
    files = listing.get("files") if isinstance(listing, dict) else None
    if not isinstance(files, dict) or not files or not all(_plain(name) for name in files):
        raise ValueError(f"{url}{TOKENIZER_PATH} lists no tokenizer files")
    total = 0
    for name in files:
        async with client.stream("GET", f"{url}{TOKENIZER_PATH}/{name}") as got:
            got.raise_for_status()
            with open(folder / name, "wb") as out:
                async for chunk in got.aiter_bytes():
                    total += len(chunk)
                    if total > MAX_TOKENIZER_BYTES:
                        raise ValueError(f"{url}'s tokenizer files exceed {MAX_TOKENIZER_BYTES} bytes")
                    out.write(chunk)


class TokenizerFolders:
    """The folders the router downloaded tokenizers into, removed when it stops."""

    def __init__(self) -> None:
        self.folders: list[Path] = []

    async def fetch(self, client: httpx.AsyncClient, urls: Iterable[str]) -> str:
        """A new folder holding the tokenizer files of the first of `urls` that serves them
        (raises the last failure, or LookupError where there is no replica to ask)."""
        failure: Exception = LookupError("no replica names this tokenizer")
        for url in urls:
            folder = Path(tempfile.mkdtemp(prefix="inferencemesh-tokenizer-"))
            try:
                await download(client, url, folder)
            except (httpx.HTTPError, ValueError, OSError) as err:
                shutil.rmtree(folder, ignore_errors=True)
                log.info("tokenizer files not read from %s: %s", url, err)
                failure = err
                continue
            self.folders.append(folder)
            log.info("the replicas' tokenizer read from %s", url)
            return str(folder)
        raise failure

    def close(self) -> None:
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)
        self.folders.clear()
