"""What never trains starts without the training libraries: a run of any control pool flow
(promote, rollback, canary, repair, approve, catalog-snapshot, usage-report) and `mint promote` /
`mint rollback` import no torch, transformers or PEFT (issue 48: they cost a rollback's process
6.7 s and 556 MB before it did anything). Each check runs in a fresh interpreter, since this
test process has long imported torch for other tests; tests/unit/test_layout.py reads the same
from the source."""

from pathlib import Path

import pytest

from flows.deployments import Pool, deployments_by_pool
from mint_core.config import MintConfig
from tests.helpers import loaded_on_import

ROOT = Path(__file__).resolve().parents[2]
TRAINING = ("torch", "transformers", "peft")


def control_entrypoints() -> list[str]:
    """The module each control pool deployment's run imports (its entrypoint's module): taken
    from the deployments, so a control flow added later is checked too."""
    deployments = deployments_by_pool(MintConfig(home=ROOT / ".mint-unused"))[Pool.CONTROL]
    return sorted({d.entrypoint.rpartition(".")[0] for d in deployments if d.entrypoint})


CLI_PROMOTE = (
    "mint_cli.main, mint_cli.rollout, mint_core.registry, mint_core.revisions, flows.promote"
)
"""What `mint promote` and `mint rollback` import: the command, then (in `cmd_promote` /
`cmd_rollback`) the registry check and the flow they run in-process."""


def test_the_control_pool_is_found() -> None:
    assert {"flows.promote", "flows.canary", "flows.repair"} <= set(control_entrypoints())


@pytest.mark.parametrize("modules", [*control_entrypoints(), CLI_PROMOTE])
def test_importing_loads_no_training_library(modules: str) -> None:
    loaded = loaded_on_import(modules, TRAINING)
    assert not loaded, f"importing {modules} loaded:\n{loaded}"
