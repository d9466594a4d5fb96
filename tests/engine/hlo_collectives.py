"""The collectives of a compiled program's HLO text, by the computation they stand in."""

import re

_COLLECTIVE = re.compile(r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(")


def collectives_by_computation(hlo: str) -> dict[str, list[str]]:
    """{computation name ("ENTRY" for the entry): its collective ops in order}; under a scan over
    layers the one non-entry computation holding collectives is the layer body."""
    found: dict[str, list] = {}
    name = None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            name = "ENTRY" if line.startswith("ENTRY") else line.split()[0]
        m = _COLLECTIVE.search(line)
        if m:
            found.setdefault(name, []).append(m.group(1))
    return found
