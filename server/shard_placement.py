"""Where a server's shards run on the Ray cluster: one SPREAD placement group with a small bundle
per shard (:func:`spread_placement_group`), the refusal of a placement whose shards no client
could reach (:func:`shard_host_refusal`), and each shard's hot standby on another node
(:func:`start_standbys`)."""

from __future__ import annotations

import ipaddress
import logging
import time
from typing import Optional, Sequence

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from optserve.server.compute.preconditioner_pool import check_gpus
from optserve.server.domain.config import ServerConfig, is_loopback
from optserve.server.standby_fleet import StandbyActors, shard_nodes, standby_nodes

log = logging.getLogger(__name__)


def shard_host_refusal(config: ServerConfig, here: str, node_ips: Sequence[str]) -> Optional[str]:
    """Why shards placed on ``node_ips`` (shard i on ``node_ips[i]``) would serve no client, in one
    line naming the shard, its node and ``--shard-host``; None when they can all serve.

    A shard listens on ``config.data_host`` on its own node. On a node other than this process's
    (``here``) a loopback address reaches no client elsewhere, and an IP address other than the
    node's own cannot be listened on (``--host 10.0.0.1`` on the head, without ``--shard-host``).
    Any interface (``0.0.0.0``) and host names are left alone; so is every shard on this node,
    which is what a single-machine server (one node, or several sharing an address) has.
    """
    host = config.data_host
    given = f"--shard-host {host}" if config.shard_host else f"--host {host}, which --shard-host defaults to"
    fix = "give --shard-host 0.0.0.0 so each shard listens on its node and advertises the node's address"
    for index, ip in enumerate(node_ips):
        if ip == here or not ip:  # "": a bundle not placed (yet)
            continue
        if is_loopback(host):
            return (f"shard {index} on node {ip} would advertise {host} ({given}), which no client on another "
                    f"machine reaches: {fix}")
        if _specific_ip(host) not in (None, ip):
            return f"shard {index} on node {ip} cannot listen on {host} ({given}), another machine's address: {fix}"
    return None


def _specific_ip(host: str) -> Optional[str]:
    """``host`` as an IP address ("[::1]" as "::1"); None for a host name or any interface."""
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    return None if address.is_unspecified else str(address)


def bundle_node_ips(group) -> list[str]:
    """The IP address of the node each bundle of the placement group ``group`` is on ("": none)."""
    ips = {node["NodeID"]: node["NodeManagerAddress"] for node in ray.nodes()}
    bundles = ray.util.placement_group_table(group)["bundles_to_node_id"]
    return [ips.get(bundles[index], "") for index in sorted(bundles)]


BUNDLE_CPUS = 0.01  # what each shard's bundle reserves: enough to be placed, nothing a task misses
PLACEMENT_TIMEOUT_S = 300.0  # longest wait for Ray to reserve the bundles (an autoscaler may add nodes)


def shard_bundles(config: ServerConfig) -> list[dict[str, float]]:
    """One placement-group bundle per shard: a token CPU amount, and the shard's GPUs."""
    bundle = {"CPU": BUNDLE_CPUS}
    if config.gpus_per_shard > 0:
        bundle["GPU"] = config.gpus_per_shard
    return [dict(bundle) for _ in range(config.shards)]


def spread_placement_group(config: ServerConfig, timeout_s: float = PLACEMENT_TIMEOUT_S, **group_options):
    """A SPREAD placement group for the shards, reserved: one bundle per shard, on as many nodes
    as the cluster has (SPREAD is soft, so one node holds them all when there is one).

    Fails fast, before asking Ray, when the embedded Ray lacks the GPUs the bundles need; on a
    cluster joined by address (an autoscaler may add nodes) it waits up to ``timeout_s``
    (:func:`~optserve.server.compute.preconditioner_pool.check_gpus`).

    Raises:
      RuntimeError: the embedded Ray has too few GPUs (at once), or Ray could not reserve the
        bundles within ``timeout_s`` (the group is removed).
    """
    check_gpus("--gpus-per-shard", config.gpus_per_shard, config.shards, "shards")
    bundles = shard_bundles(config)
    group = placement_group(bundles, strategy="SPREAD", **group_options)
    ready = group.ready()
    deadline = time.monotonic() + timeout_s
    while True:
        done, _ = ray.wait([ready], timeout=min(30.0, max(0.0, deadline - time.monotonic())))
        if done:
            return group
        if time.monotonic() >= deadline:
            remove_placement_group(group)
            raise RuntimeError(f"Ray could not place {len(bundles)} shards (a bundle of {bundles[0]} each) "
                               f"within {timeout_s:.0f} s: the cluster's nodes lack the resources")
        log.warning("waiting for Ray to place %d shards (a bundle of %s each)", len(bundles), bundles[0])


def start_standbys(config: ServerConfig, group, start_actor) -> StandbyActors:
    """Each shard's standby, on another live node than its primary's bundle (see
    :mod:`~optserve.server.standby_fleet`)."""
    bundles = ray.util.placement_group_table(group)["bundles_to_node_id"]
    return StandbyActors(start_actor, standby_nodes([bundles[i] for i in sorted(bundles)], shard_nodes(),
                                                    config.replica_same_node), config.replica_same_node)
