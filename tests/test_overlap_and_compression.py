"""Overlap (one-step-delayed updates) and bf16 transport, against a real server."""

from __future__ import annotations

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import optserve.client.jax as ojax
from optserve.client import Client
from optserve.client.torch import RemoteOptimizer, tensor_to_numpy, write_numpy_
from optserve.demo import digits

ADAM = {"name": "adam", "args": {"learning_rate": 1e-2}}
STEPS = 12


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _data():
    g = torch.Generator().manual_seed(3)
    return torch.randn(24, 6, generator=g), torch.randn(24, 3, generator=g)


def _loss_and_grads(model, x, y) -> tuple[float, dict[str, np.ndarray]]:
    model.zero_grad()
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()
    return loss.item(), {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


# --- overlap ----------------------------------------------------------------------------------


def test_torch_overlap_gives_exactly_the_one_step_delayed_trajectory(server, unique_name):
    x, y = _data()
    model = _model()
    optimizer = RemoteOptimizer(model.named_parameters(), server.address, ADAM, session=unique_name + "-overlap", overlap=True)
    overlapped = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        overlapped.append(loss.item())
    optimizer.synchronize()

    # The same delay, made by hand with blocking push_pull: m_t = w_{t-1}, m_0 = w_0.
    reference_model = _model()
    w0 = {n: tensor_to_numpy(p).copy() for n, p in reference_model.named_parameters()}
    session = Client(server.address).create_session(unique_name + "-reference", w0, optimizer=ADAM)
    history = [w0, w0]
    delayed = []
    for t in range(STEPS):
        for n, p in reference_model.named_parameters():
            write_numpy_(p, history[t][n])
        loss, grads = _loss_and_grads(reference_model, x, y)
        delayed.append(loss)
        history.append(session.push_pull(grads))

    assert overlapped == delayed  # exactly, not approximately
    assert overlapped[1] == overlapped[0], "the first step's parameters arrive one step late"
    assert overlapped[-1] < 0.8 * overlapped[0]
    for n, p in model.named_parameters():
        np.testing.assert_array_equal(p.detach().numpy(), history[-1][n])
    assert optimizer.version == session.version == STEPS
    optimizer.session.close()
    session.close()


def test_jax_delayed_stepper_gives_exactly_the_one_step_delayed_trajectory(server, unique_name):
    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(3, 4), "b": jnp.zeros(4)}
    x = jnp.arange(15.0).reshape(5, 3) / 10
    y = jnp.ones((5, 4))
    grad_fn = jax.jit(jax.value_and_grad(lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2)))

    session = ojax.create_session(server.address, unique_name + "-overlap", params, optimizer=ADAM)
    stepper = ojax.DelayedPytreeStepper(session)
    current, overlapped = params, []
    for _ in range(STEPS):
        loss, grads = grad_fn(current)
        overlapped.append(float(loss))
        previous = stepper.step(grads)
        current = current if previous is None else previous
    final = stepper.wait()

    reference = ojax.create_session(server.address, unique_name + "-reference", params, optimizer=ADAM)
    history, delayed = [params, params], []
    for t in range(STEPS):
        loss, grads = grad_fn(history[t])
        delayed.append(float(loss))
        history.append(reference.push_pull(grads))
    assert overlapped == delayed
    for a, b in zip(jax.tree_util.tree_leaves(final), jax.tree_util.tree_leaves(history[-1])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    session.close()
    reference.close()


# --- compression ------------------------------------------------------------------------------


def _wire_size(message) -> int:
    """Bytes of a message as the client hands it to gRPC or gets it back: a generated message,
    a pre-encoded chunk message (bytes), or a decoded ``(kind, value)`` pair (chunks: their data)."""
    if isinstance(message, (bytes, bytearray, memoryview)):
        return len(message)
    if isinstance(message, tuple):
        kind, value = message
        if kind == "chunk":
            return len(value.data)
        return value.ByteSize() if hasattr(value, "ByteSize") else 0
    return message.ByteSize()


class _ByteCounter(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Counts serialized protobuf bytes sent and received through the channels it wraps."""

    def __init__(self):
        self.sent = 0
        self.received = 0

    def _count_requests(self, requests):
        for request in requests:
            self.sent += _wire_size(request)
            yield request

    def _counted_responses(self, call):
        counter = self

        class _Call:
            def __iter__(self):
                return self

            def __next__(self):
                response = next(call)
                counter.received += _wire_size(response)
                return response

            def __getattr__(self, name):
                return getattr(call, name)

        return _Call()

    def intercept_unary_unary(self, continuation, details, request):
        self.sent += _wire_size(request)
        outcome = continuation(details, request)
        self.received += _wire_size(outcome.result()) if outcome.exception() is None else 0
        return outcome

    def intercept_unary_stream(self, continuation, details, request):
        self.sent += _wire_size(request)
        return self._counted_responses(continuation(details, request))

    def intercept_stream_unary(self, continuation, details, request_iterator):
        outcome = continuation(details, self._count_requests(request_iterator))
        self.received += _wire_size(outcome.result()) if outcome.exception() is None else 0
        return outcome

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return self._counted_responses(continuation(details, self._count_requests(request_iterator)))


class _LoopByteCounter(grpc.aio.StreamStreamClientInterceptor):
    """:class:`_ByteCounter`'s count of the stream calls on ``grpc.aio`` channels (the SDK's
    PushPull calls, client/_loop_call.py), into the same totals."""

    def __init__(self, counter: _ByteCounter):
        self._counter = counter

    async def intercept_stream_stream(self, continuation, details, request_iterator):
        counter = self._counter

        async def requests():
            async for request in request_iterator:
                counter.sent += _wire_size(request)
                yield request

        call = await continuation(details, requests())

        async def responses():
            async for response in call:
                counter.received += _wire_size(response)
                yield response

        return responses()


@pytest.fixture
def byte_counter(monkeypatch) -> _ByteCounter:
    """Wraps every gRPC channel opened during the test (synchronous or ``grpc.aio``) with a
    :class:`_ByteCounter`."""
    counter = _ByteCounter()
    real, real_on_loop = grpc.insecure_channel, grpc.aio.insecure_channel

    def counting_channel(*args, **kwargs):
        return grpc.intercept_channel(real(*args, **kwargs), counter)

    def counting_channel_on_loop(*args, interceptors=None, **kwargs):
        return real_on_loop(*args, interceptors=[*(interceptors or ()), _LoopByteCounter(counter)], **kwargs)

    monkeypatch.setattr(grpc, "insecure_channel", counting_channel)
    monkeypatch.setattr(grpc.aio, "insecure_channel", counting_channel_on_loop)
    return counter


def _bytes_for_steps(counter: _ByteCounter, address: str, name: str, steps: int, call_kwargs=None, **session_kwargs) -> tuple[int, int]:
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((256, 256), np.float32), "v": rng.standard_normal((4096,), np.float32)}
    # shared_memory=False: these tests count the tensor bytes gRPC carries (test_shared_memory.py
    # counts the fast path's)
    session = Client(address, shared_memory=session_kwargs.pop("shared_memory", False)).create_session(name, params, optimizer={"name": "sgd", "args": {"learning_rate": 1e-3}}, **session_kwargs)
    sent0, received0 = counter.sent, counter.received
    for _ in range(steps):
        session.push_pull({k: rng.standard_normal(v.shape, np.float32) for k, v in params.items()}, **(call_kwargs or {}))
    sent, received = counter.sent - sent0, counter.received - received0
    session.close()
    return sent, received


def test_bfloat16_transport_halves_the_bytes_sent_and_received(server, unique_name, byte_counter):
    sent32, received32 = _bytes_for_steps(byte_counter, server.address, unique_name + "-f32", 3)
    sent16, received16 = _bytes_for_steps(byte_counter, server.address, unique_name + "-bf16", 3, wire_dtype="bfloat16")
    payload = 3 * (256 * 256 + 4096) * 4  # float32 gradient bytes of three pushes
    assert payload <= sent32 < 1.05 * payload, "the counter must see the gradients themselves"
    assert 0.48 < sent16 / sent32 < 0.52, (sent16, sent32)
    assert 0.48 < received16 / received32 < 0.52, (received16, received32)
    # The same, chosen per call on a float32 session.
    sent_call, received_call = _bytes_for_steps(
        byte_counter, server.address, unique_name + "-call", 3, call_kwargs={"wire_dtype": "bfloat16"})
    assert 0.48 < sent_call / sent32 < 0.52 and 0.48 < received_call / received32 < 0.52


def _train_digits(address: str, name: str, wire_dtype, steps: int = 80) -> float:
    data = digits.load_digits_split()
    model = digits.make_model(seed=0)
    optimizer = RemoteOptimizer(model.named_parameters(), address, ADAM, session=name, wire_dtype=wire_dtype)
    rng = np.random.default_rng(0)
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    for _ in range(steps):
        batch = torch.from_numpy(rng.integers(0, len(x), 32))
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        optimizer.step()
    optimizer.session.close()
    optimizer.close()
    return digits.evaluate(model, data.x_train, data.y_train)[0]


def test_bfloat16_transport_trains_the_demo_model_within_two_percent(server, unique_name):
    initial = digits.evaluate(digits.make_model(seed=0), digits.load_digits_split().x_train, digits.load_digits_split().y_train)[0]
    full = _train_digits(server.address, unique_name + "-f32", None)
    compressed = _train_digits(server.address, unique_name + "-bf16", "bfloat16")
    assert full < 0.25 * initial, (initial, full)
    assert abs(compressed - full) <= 0.02 * full, (compressed, full)


def test_async_overlap_stamps_pushes_with_the_version_their_gradient_saw(server, unique_name):
    """With one push in flight, each gradient was computed one version behind: staleness 1."""
    from optserve.client.overlap import DelayedStepper

    params = {"w": np.ones((4, 3), np.float32)}
    session = Client(server.address).create_session(
        unique_name, params, optimizer={"name": "sgd", "args": {"learning_rate": 0.1}}, mode="async")
    stepper = DelayedStepper(session)
    held = params
    stalenesses = []
    for _ in range(5):
        grads = {"w": held["w"] * 0.5}  # any gradient computed on the parameters held now
        returned = stepper.step(grads)
        stalenesses.append(session.last_staleness)
        if returned is not None:
            held = returned
    stepper.wait()
    stalenesses.append(session.last_staleness)
    session.close()
    # stalenesses[i] is that of push i-1 (step i waits for it). The first push was computed on
    # the current version; every later one on the version before the push then in flight.
    assert stalenesses[1] == 0, stalenesses
    assert stalenesses[2:] == [1] * 4, stalenesses
