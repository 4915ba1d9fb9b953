"""Folders that must stay apart: the raw source, the dataset, the checkpoints and the scores.

One inside another (or the same) means one stage writes into, replaces or deletes what
another owns: scores and ledger files among the dataset's shards, a prepare's commit that
swaps the checkpoints away, a dataset's shards read back as raw input. Compared as every
host opens them (foundation.storage.resolve: absolute local paths, URLs as written; a
local folder through its symbolic links too), before anything starts.
"""

from __future__ import annotations

import os

from .errors import ConfigError
from .storage import display, is_remote, local_path

_GLOB = set("*?[")


def glob_base(url: str) -> str:
    """A raw source's glob (`raw/*.csv`) as the folder its files are in: the folders before
    its first pattern (pipelines.sources reads `*`, `?` and `[` as patterns)."""
    parts = url.rstrip("/").split("/")
    for i, part in enumerate(parts):
        if _GLOB & set(part):
            return "/".join(parts[:i]) or "/"
    return url


def _folder(url: str) -> str:
    """A location comparable by prefix: a local path without file:// and through its links,
    no trailing slash."""
    url = url.rstrip("/") or "/"
    if is_remote(url):
        return url
    return os.path.realpath(local_path(url))


def inside(inner: str, outer: str) -> bool:
    """Whether `inner` is `outer` or lies within it."""
    a, b = _folder(inner), _folder(outer)
    return a == b or a.startswith(b.rstrip("/") + "/")


def check_apart(named: list[tuple[str, str]]) -> None:
    """(setting, resolved URL) pairs: refused in one line naming both settings when one is
    inside the other."""
    for i, (a, url_a) in enumerate(named):
        for b, url_b in named[i + 1:]:
            if _folder(url_a) == _folder(url_b):
                how = f"{a} and {b} are the same folder ({display(url_a)!r})"
            elif inside(url_a, url_b) or inside(url_b, url_a):
                (inner, in_url), (outer, out_url) = ((a, url_a), (b, url_b)) if inside(url_a, url_b) else \
                    ((b, url_b), (a, url_a))
                how = f"{inner} is inside {outer} ({display(in_url)!r} in {display(out_url)!r})"
            else:
                continue
            raise ConfigError(f"{how}: each needs a folder of its own (one stage would write into, replace "
                              f"or delete what the other holds)")
