"""This machine's Debian package sources for one release, read from its apt configuration.

Never a hard-coded mirror: a user behind a mirror (or a snapshot) has other URLs, and their apt
configuration already names them.

  apt_sources.py SUITE            one-line `deb` entries (what mmdebstrap takes as mirrors) for
                                  SUITE and its -updates / -security suites
  apt_sources.py --deb-src SUITE  a deb822 `deb-src` stanza for SUITE main (for `apt-get source`)
"""

from __future__ import annotations

import sys
from pathlib import Path

APT = Path("/etc/apt")


def deb822_stanzas(text: str) -> list[dict[str, str]]:
    stanzas, current = [], {}
    for line in text.splitlines() + [""]:
        if line.startswith("#"):
            continue
        if not line.strip():
            if current:
                stanzas.append(current)
            current = {}
            continue
        if line[0].isspace() and current:  # continuation line
            last = next(reversed(current))
            current[last] += "\n" + line.strip()
            continue
        key, _, value = line.partition(":")
        current[key.strip().lower()] = value.strip()
    return stanzas


def entries() -> list[dict]:
    """Every enabled source: {types, uris, suites, components, signed_by}."""
    found = []
    for path in sorted(APT.glob("sources.list.d/*.sources")):
        for s in deb822_stanzas(path.read_text()):
            if s.get("enabled", "yes").lower() == "no":
                continue
            found.append({"types": s.get("types", "").split(), "uris": s.get("uris", "").split(),
                          "suites": s.get("suites", "").split(), "components": s.get("components", "").split(),
                          "signed_by": s.get("signed-by", "")})
    for path in [APT / "sources.list", *sorted(APT.glob("sources.list.d/*.list"))]:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            words = line.split("#", 1)[0].split()
            if len(words) < 3 or words[0] not in ("deb", "deb-src"):
                continue
            signed_by = ""
            if words[1].startswith("["):  # options: [arch=amd64 signed-by=/path]
                opts = []
                while words and not words[1].endswith("]"):
                    opts.append(words.pop(1))
                opts.append(words.pop(1))
                for opt in " ".join(opts).strip("[]").split():
                    if opt.startswith("signed-by="):
                        signed_by = opt.split("=", 1)[1]
            found.append({"types": [words[0]], "uris": [words[1]], "suites": [words[2]],
                          "components": words[3:], "signed_by": signed_by})
    return found


def is_release_suite(suite: str, release: str) -> bool:
    return suite == release or suite.startswith(release + "-")


def deb_lines(release: str) -> list[str]:
    lines = []
    for e in entries():
        if "deb" not in e["types"]:
            continue
        for uri in e["uris"]:
            for suite in e["suites"]:
                if is_release_suite(suite, release):
                    lines.append(f"deb {uri} {suite} {' '.join(e['components'])}")
    return lines


def deb_src_stanza(release: str) -> str:
    for e in entries():
        if "deb" in e["types"] and release in e["suites"] and "main" in e["components"]:
            stanza = f"Types: deb-src\nURIs: {e['uris'][0]}\nSuites: {release}\nComponents: main\n"
            if e["signed_by"] and "\n" not in e["signed_by"]:
                stanza += f"Signed-By: {e['signed_by']}\n"
            return stanza
    raise SystemExit(f"no enabled `deb` source for {release} main in {APT}")


def main(argv: list[str]) -> None:
    if len(argv) == 2 and argv[0] == "--deb-src":
        print(deb_src_stanza(argv[1]), end="")
    elif len(argv) == 1:
        lines = deb_lines(argv[0])
        if not lines:
            raise SystemExit(f"no enabled `deb` source for {argv[0]} in {APT}")
        print("\n".join(lines))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
