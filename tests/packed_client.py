"""The one spark-submit application of tests/test_packaging.py: `prepare` run exactly as
jobs/spark_submit.py runs it, then tests/user_code_client.py's stages, in the same
application (the same SparkContext, the same executor). Every application unpacks the
~2 GB packed venv twice, once for the driver (client mode) and once for its executor:
one application for both checks unpacks it twice instead of four times.

    spark-submit ... tests/packed_client.py <prepare's arguments> -- <user_code_client.py's arguments>

Prints `PREPARED` on a line of its own between the two, so that each check reads its own
part of the output.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `tests`, when run as a script

MARK = "PREPARED"


def main() -> None:
    args = sys.argv[1:]
    cut = args.index("--")
    # jobs/spark_submit.py as its own __main__: the entry point users submit, not a copy of it.
    # shardline's CLI runs click with standalone_mode=False: it returns after a command,
    # and exits the process (non-zero) on an error, so the stages below run only after a
    # prepare that succeeded. The session stays open for them.
    sys.argv = [str(REPO / "jobs" / "spark_submit.py"), *args[:cut]]
    runpy.run_path(sys.argv[0], run_name="__main__")
    print(MARK, flush=True)
    from tests import user_code_client

    sys.argv = [user_code_client.__file__, *args[cut + 1 :]]
    user_code_client.main()  # stops the session at its end


if __name__ == "__main__":
    main()
