"""Each tier's time and the 15 slowest tests of a `make test-all` run (tests/tiers.sh), read
from the JUnit XML files pytest wrote for each tier: `python tests/tier_times.py A.xml B.xml`.

A test's time is its setup, call and teardown (pytest's default for JUnit XML): a session
fixture's start is charged to the first test that asks for it."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SLOWEST = 15


def main(paths: list[str]) -> int:
    tests = []
    print("test-all: tiers")
    for path in paths:
        tier = Path(path).stem
        if not Path(path).exists():
            print(f"  {tier:<10} no results ({path} missing: pytest did not get to write it)")
            continue
        suite = ET.parse(path).getroot()
        suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        print(f"  {tier:<10} {float(suite.get('time', 0)):7.1f} s  {counts['tests']} tests, "
              f"{counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped")
        for case in suite.iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            tests.append((float(case.get("time", 0)), tier, name))
    print(f"test-all: the {SLOWEST} slowest tests (setup + call + teardown)")
    for seconds, tier, name in sorted(tests, reverse=True)[:SLOWEST]:
        print(f"  {seconds:7.1f} s  {tier:<10} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
