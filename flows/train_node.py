"""One more host's share of a training launched on several (`release --nnodes`): the release's
run, node 0, starts a run of this flow per other node in the train pool."""

from prefect import flow

from flows.ending import ends_on_mint_error
from mint_core.config import MintConfig
from mint_core.distributed import DEFAULT_TIMEOUT_S, Launch
from tasks.launch import join_launch


@flow(name="train-node", flow_run_name="train node {node_rank} of {name}")
@ends_on_mint_error
def train_node(
    name: str,
    node_rank: int,
    rdzv_endpoint: str,
    nproc_per_node: int = 1,
    nnodes: int = 2,
    dist_timeout_s: float = DEFAULT_TIMEOUT_S,
) -> None:
    """Run node `node_rank`'s training processes of the launch `name`, until they end. Started
    by a release that trains on several hosts, not by hand.

    Args:
        name: The launch this node joins (the release run's training names it).
        node_rank: This node's place among the `nnodes` (node 0 is the release's host).
        rdzv_endpoint: HOST:PORT of node 0, where the ranks meet.
        nproc_per_node: Training processes on this host.
        nnodes: Hosts in the launch.
        dist_timeout_s: torch.distributed's timeout for the rendezvous and each collective.
    """
    launch = Launch(nproc_per_node, nnodes, rdzv_endpoint, dist_timeout_s)
    join_launch(MintConfig.from_env(), launch, name, node_rank)
