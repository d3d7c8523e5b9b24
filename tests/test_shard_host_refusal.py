"""Which shard placements ``optserve serve`` refuses to start (``shard_placement.shard_host_refusal``):
a shard on another machine than the coordinator that would advertise a loopback address, or
listen on an IP address that is not its node's, where ``--shard-host`` (default: ``--host``)
says so. The refusal on real separate hosts: tests/test_netbed.py."""

from __future__ import annotations

import pytest

from optserve.server.domain.config import ServerConfig
from optserve.server.shard_placement import shard_host_refusal

HERE, ELSEWHERE = "10.0.0.1", "10.0.0.2"


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "10.0.0.1", "0.0.0.0", "h1.example"])
def test_shards_all_on_the_coordinators_node_are_never_refused(host):
    assert shard_host_refusal(ServerConfig(host=host, insecure=True), HERE, [HERE, HERE]) is None


def test_a_shard_elsewhere_advertising_loopback_is_refused_naming_it_its_node_and_shard_host():
    said = shard_host_refusal(ServerConfig(), HERE, [HERE, ELSEWHERE])
    assert said == ("shard 1 on node 10.0.0.2 would advertise 127.0.0.1 (--host 127.0.0.1, which --shard-host "
                    "defaults to), which no client on another machine reaches: give --shard-host 0.0.0.0 so each "
                    "shard listens on its node and advertises the node's address")


@pytest.mark.parametrize("shard_host", ["::1", "[::1]", "localhost", "127.0.0.2"])
def test_an_explicit_loopback_shard_host_elsewhere_is_refused_as_given(shard_host):
    said = shard_host_refusal(ServerConfig(shard_host=shard_host), HERE, [ELSEWHERE, ELSEWHERE])
    assert said.startswith(f"shard 0 on node 10.0.0.2 would advertise {shard_host} (--shard-host {shard_host})"), said


def test_the_heads_address_as_host_elsewhere_is_refused_as_unlistenable():
    said = shard_host_refusal(ServerConfig(host=HERE, insecure=True), HERE, [ELSEWHERE])
    assert said.startswith("shard 0 on node 10.0.0.2 cannot listen on 10.0.0.1 (--host 10.0.0.1, which "
                           "--shard-host defaults to), another machine's address: give --shard-host 0.0.0.0"), said


@pytest.mark.parametrize("shard_host", ["0.0.0.0", "::", "[::]", "shards.example"])
def test_any_interface_or_a_host_name_elsewhere_is_left_to_serve(shard_host):
    config = ServerConfig(shard_host=shard_host, insecure=True)
    assert shard_host_refusal(config, HERE, [ELSEWHERE, HERE]) is None


def test_a_shard_host_that_is_the_nodes_own_address_or_an_unplaced_bundle_is_left_alone():
    assert shard_host_refusal(ServerConfig(shard_host=ELSEWHERE, insecure=True), HERE, [ELSEWHERE]) is None
    assert shard_host_refusal(ServerConfig(), HERE, ["", HERE]) is None
