"""The fleet tests certify chunkserve behind real routers (SMG, Dynamo's indexer, Ray Serve), which
come in the `fleet` extra that `make test-all` installs. Without it these tests fail, naming the
install, rather than skip: a skip would let a broken install pass CI unseen. (Checked when a test
runs, not at collection: the default tier deselects them and needs no extra.)"""

from __future__ import annotations

import importlib.util

import pytest

from chunkserve.bench.smg import smg_binary

FLEET_MODULES = ("dynamo.indexer", "ray.serve")


@pytest.fixture(autouse=True, scope="session")
def fleet_extra_installed() -> None:
    missing = [name for name in FLEET_MODULES if importlib.util.find_spec(name.split(".")[0]) is None
               or importlib.util.find_spec(name) is None]
    if smg_binary() is None:
        missing.append("smg")
    if missing:
        pytest.fail(f"the fleet extra is not installed (missing {', '.join(missing)}): make test-all installs it, "
                    f"or pip install -e '.[fleet]'")
