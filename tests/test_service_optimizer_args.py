"""Through a real server: optimizer arguments that break their value rules are refused at
CreateSession (INVALID_ARGUMENT naming the argument) and leave no session behind.

Uses the suite's in-process server (``server`` in conftest.py: :func:`optserve.server.app.start_server`
with a :class:`~optserve.server.domain.config.ServerConfig`, one per run).
"""

from __future__ import annotations

import pytest

from _service_helpers import make_grads, make_params
from optserve.client import Client, InvalidArgumentError

BAD = [
    ("nan-lr", {"name": "adam", "args": {"learning_rate": float("nan")}}, "learning_rate", "nan"),
    ("inf-lr", {"name": "sgd", "args": {"learning_rate": float("inf")}}, "learning_rate", "inf"),
    ("list-lr", {"name": "adam", "args": {"learning_rate": [1, 2]}}, "learning_rate", "[1, 2]"),
    ("b1-1.5", {"name": "adam", "args": {"learning_rate": 0.01, "b1": 1.5}}, "b1", "0 <= b1 < 1"),
    ("hf-beta1", {"name": "adafactor_hf", "args": {"lr": 0.01, "relative_step": False, "beta1": 1.0}}, "beta1",
     "0 <= beta1 < 1"),
    ("shampoo-steps", {"name": "shampoo", "args": {"learning_rate": 0.01, "preconditioning_compute_steps": 0}},
     "preconditioning_compute_steps", ">= 1"),
]


@pytest.fixture(scope="module")
def client(server):
    with Client(server.address, timeout=60) as c:
        yield c


def test_bad_argument_values_are_refused_at_creation_and_leave_no_session(client, unique_name):
    params = make_params()
    names = []
    for label, optimizer, option, fragment in BAD:
        name = f"{unique_name}-{label}"
        names.append(name)
        with pytest.raises(InvalidArgumentError) as info:
            client.create_session(name, params, optimizer=optimizer)
        message = str(info.value)
        assert f"'{optimizer['name']}'" in message and f"'{option}'" in message and fragment in message, message
    listed = set(client.list_sessions())
    assert not listed & set(names), listed & set(names)

    # Nothing was placed under those names: a good spec creates the session and steps.
    session = client.create_session(names[0], params, optimizer={"name": "adam", "args": {"learning_rate": 0.01}})
    try:
        session.push(make_grads(params, 0))
        assert session.version == 1
    finally:
        session.close()
