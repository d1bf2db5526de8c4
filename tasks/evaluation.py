"""The evaluation gate as a step: the candidate and `production` scored on the same rows,
through a worker of their base (`mint_core.planning.evaluation` chooses the rows and judges)."""

from prefect import task
from prefect.artifacts import create_table_artifact
from prefect.cache_policies import NO_CACHE

from mint_core.artifacts.stores import open_store, read_data
from mint_core.config import MintConfig
from mint_core.errors import NotFoundError, RejectedError
from mint_core.gates import Gates
from mint_core.model.datasets import located, parse_jsonl
from mint_core.model.training import EVAL_GENERATION_ROWS
from mint_core.planning.evaluation import (
    EVAL_ROWS_TAG,
    Evaluation,
    Generate,
    Rows,
    SetScore,
    choose_eval_sets,
    exact_match,
    load_rows,
)
from mint_core.registry import Registry
from mint_core.revisions import RevisionId, RevisionRef
from tasks.fleet import Fleet, fleet_for
from tasks.runs import run_log


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate_revision(
    config: MintConfig,
    revision: RevisionId,
    gates: Gates,
    actor: str = "mint",
    fleet: Fleet | None = None,
) -> Evaluation | None:
    """Score `revision` and the revision serving `production` on the same rows, through one
    worker of their base: the eval set (the gates' `eval_data`, else production's held-out
    rows, else the candidate's own) and the gates' `regression_data`. Both scores go on the
    candidate's model version and into a Prefect table artifact `eval-<adapter>`. RejectedError
    (stage `rejected`) when the candidate falls behind by more than `gates.max_regression` on
    any set. None, noted in the stage history, when there is nothing to compare: no
    production revision (training already scored a first revision on its held-out rows) or
    no rows."""
    registry = Registry(config.tracking_uri)
    try:
        production = registry.resolve(RevisionRef(revision.adapter)).id
    except NotFoundError:
        production = None
    if production in (None, revision):
        registry.note_stage(revision, actor, "evaluation passed: no other revision in production")
        run_log().info("%s evaluation passed: no other revision in production", revision)
        return None
    store = open_store(config)

    def read(where: str) -> Rows:
        return parse_jsonl(read_data(config, where), located(where)).rows

    def stored(holder: RevisionId) -> Rows | None:
        """The held-out rows `holder` was trained with; None for an imported adapter."""
        name = registry.get(holder).tags.get(EVAL_ROWS_TAG)
        if name is None:
            return None
        return load_rows(store, config.work_root / "eval-rows", name, holder)

    sets = choose_eval_sets(gates, revision, production, read, stored, EVAL_GENERATION_ROWS)
    if not sets:
        registry.note_stage(
            revision,
            actor,
            f"evaluation passed: no rows to score {revision} and {production} on (neither has "
            "held-out rows, and the adapter's gates name no eval_data)",
        )
        run_log().info("%s evaluation passed: no rows to score it and %s on", revision, production)
        return None
    worker = fleet_for(config, revision, fleet).workers[0]

    def served(which: RevisionId) -> Generate:
        return lambda prompts, budget: worker.greedy_texts(str(which), prompts, budget)

    scores = tuple(
        SetScore(
            name,
            len(rows),
            exact_match(rows, served(revision)),
            exact_match(rows, served(production)),
            source,
        )
        for name, (rows, source) in sets.items()
    )
    evaluation = Evaluation(revision, production, scores, gates.max_regression)
    for key, value in evaluation.tags().items():
        registry.set_revision_tag(revision, key, value)
    create_table_artifact(
        evaluation.table(), key=f"eval-{revision.adapter}", description=evaluation.reason()
    )
    if not evaluation.passed:
        registry.reject(revision, actor, evaluation.reason())
        run_log().warning("%s %s", revision, evaluation.reason())
        raise RejectedError(f"{evaluation.reason()}; production did not move")
    registry.note_stage(revision, actor, evaluation.reason())
    run_log().info("%s %s", revision, evaluation.reason())
    return evaluation
