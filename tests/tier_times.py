"""Each tier's time and the 15 slowest tests of a `make test-all` run (tests/tiers.sh), read
from the JUnit XML file its one pytest wrote, where each test carries its tier (the `tier`
property tests/conftest.py records): `python tests/tier_times.py all.xml`.

A test's time is its setup, call and teardown (pytest's default for JUnit XML): a session
fixture's start is charged to the first test that asks for it. A tier's time is the sum of
its tests'. Exit 5 (pytest's "no tests collected") when a tier has no test: a marker
expression or a conftest change that empties one must not pass silently."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SLOWEST = 15
TIERS = ("quick", "full-only")


def main(path: str) -> int:
    if not Path(path).exists():
        print(f"test-all: no results ({path} missing: pytest did not get to write it)")
        return 1
    tests, tiers = [], {t: {"time": 0.0, "tests": 0, "failed": 0, "errors": 0, "skipped": 0} for t in TIERS}
    for case in ET.parse(path).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        tier_name = props.get("tier", "unknown")
        tier = tiers.setdefault(tier_name, dict.fromkeys(tiers["quick"], 0))
        seconds = float(case.get("time", 0))
        tier["time"] += seconds
        tier["tests"] += 1
        for tag, key in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            tier[key] += case.find(tag) is not None
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        tests.append((seconds, tier_name, name))
    print("test-all: tiers")
    for name, t in tiers.items():
        print(f"  {name:<10} {t['time']:7.1f} s  {t['tests']} tests, {t['failed']} failed, {t['errors']} errors, "
              f"{t['skipped']} skipped")
    print(f"test-all: the {SLOWEST} slowest tests (setup + call + teardown)")
    for seconds, tier, name in sorted(tests, reverse=True)[:SLOWEST]:
        print(f"  {seconds:7.1f} s  {tier:<10} {name}")
    empty = [name for name in TIERS if not tiers[name]["tests"]]
    if empty:
        print(f"test-all: no test ran in the {' and '.join(empty)} tier(s)")
        return 5
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
