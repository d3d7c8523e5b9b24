"""What a SparseLoCo exchange costs in CPU against one inner step of the same model.

    .venv/bin/python -m bench.sparseloco            # 6 Linear(4096, 4096): ~100.7M parameters
    .venv/bin/python -m bench.sparseloco --small    # 6 Linear(512, 512), a quick smoke run

The model is a torch MLP; its inner step (forward and backward on a batch of ``--batch``, then
AdamW) is the baseline. The exchange's parts, each timed on its own (medians over rounds in which
every part and the inner step take turns, after a warm-up round):

- compress: a worker's ``ErrorFedSparsifier.compress`` of the whole pseudo-gradient (error
  feedback, the top 64 of each 64x64 tile, 2-bit values; a tensor per thread, up to the cores)
  and its chunk payloads (the bytes it pushes);
- decode: the shard's decoding of one worker's chunks into float32 buffers (what its assembler
  does per push);
- rebuild: a worker's rebuild of the parameters from the snapshot and ``--workers`` workers'
  parts (``apply_parts``, a tensor per thread: what the compact answer costs it).

It prints each median, its ratio to the inner step, and the bytes per parameter each way.
"""

from __future__ import annotations

import argparse
import statistics

import numpy as np

from bench._timing import print_table
from bench.service import interleaved_seconds
from optserve.client._sparseloco import ErrorFedSparsifier, SparseLoCo
from optserve.protos import contract, sparse_codec


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.sparseloco")
    parser.add_argument("--small", action="store_true", help="6 Linear(512, 512) instead of 6 Linear(4096, 4096)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, default=4, help="workers whose parts a rebuild reads")
    args = parser.parse_args(argv)
    import torch

    torch.manual_seed(0)
    width = 512 if args.small else 4096
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(6)])
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(args.batch, width), torch.randn(args.batch, width)

    def inner_step():
        inner.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        inner.step()

    names = [n for n, _ in model.named_parameters()]
    snapshot = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    rng = np.random.default_rng(1)
    deltas = [{n: (rng.standard_normal(v.shape) * 1e-3).astype(np.float32) for n, v in snapshot.items()}
              for _ in range(args.workers)]
    sparsifiers = [ErrorFedSparsifier(SparseLoCo()) for _ in range(args.workers)]
    parts = {n: [] for n in names}
    for sparsifier, delta in zip(sparsifiers, deltas):  # each worker's selections, as the shard gets them
        for name, selection in sparsifier.compress(delta).items():
            parts[name].append(list(selection.payloads(contract.DEFAULT_CHUNK_BYTES)))
    buffers = {n: np.empty(v.size, np.float32) for n, v in snapshot.items()}
    parameters = sum(v.size for v in snapshot.values())
    sent_bytes = sum(len(data) for name in names for offset, data in parts[name][0])

    def compress():
        for selection in sparsifiers[0].compress(deltas[0]).values():
            for _ in selection.payloads(contract.DEFAULT_CHUNK_BYTES):
                pass

    def decode():
        for name in names:
            for offset, data in parts[name][0]:
                sparse_codec.decode_into(buffers[name], snapshot[name].shape, offset, data)

    def rebuild():  # a tensor per thread, as the client's reassembly does
        sparse_codec.tensor_map(lambda name: sparse_codec.apply_parts(snapshot[name], parts[name], over_senders=True),
                                names, [snapshot[name].size for name in names])

    samples, _ = interleaved_seconds({"inner step": inner_step, "compress": compress, "decode": decode,
                                      "rebuild": rebuild}, rounds=args.rounds)
    step = statistics.median(samples["inner step"])
    rows = [[name, statistics.median(times), statistics.median(times) / step] for name, times in samples.items()]
    print_table(f"SparseLoCo exchange vs one inner step: {parameters / 1e6:.1f}M parameters, batch {args.batch}, "
                f"{args.workers} workers' parts per rebuild; medians of {args.rounds} rounds",
                ["what", "median s", "x inner step"], rows)
    print(f"bytes per parameter: up {sent_bytes / parameters:.4f} ({8 * sent_bytes / parameters:.3f} bits), "
          f"down {args.workers * sent_bytes / parameters:.4f} ({args.workers} workers' parts; dense float32: 4)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
