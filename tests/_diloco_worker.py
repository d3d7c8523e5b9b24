"""One DiLoCo worker as its own process (tests/test_diloco.py):

    python -m tests._diloco_worker ADDRESS SESSION WORKER_ID ROUNDS H

Trains the test model with AdamW for ROUNDS x H inner steps on its own data through
``optserve.client.torch.DiLoCo`` (an elastic session of 3 workers, min_workers 1: a worker that
joined late finishes its rounds after the others left; a long straggler deadline: rounds wait for
every live member, so the test's rounds do not depend on the machine's load) and prints
``round <n> <version>`` after each exchange, ``done`` at the end. A SIGTERM ends it after the
round it is in (closed, ``done``): a test stops it once the rounds it waits for happened, whatever
the machine's speed.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

import torch

from optserve.client.torch import DiLoCo


def main(address: str, session: str, worker_id: str, rounds: int, h: int) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    diloco = DiLoCo(model, inner, address, session=session, sync_every=h, num_workers=3, min_workers=1,
                    straggler_s=60.0,
                    worker_id=worker_id)
    g = torch.Generator().manual_seed(sum(map(ord, worker_id)))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    for step in range(rounds * h):
        x, y = torch.randn(16, 6, generator=g), torch.randn(16, 3, generator=g)
        inner.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        time.sleep(0.01)
        diloco.step()
        if (step + 1) % h == 0:
            print(f"round {diloco.rounds[0]} {diloco.sessions[0].version}", flush=True)
            if stop.is_set():
                break
    diloco.close()
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
