"""Packed convolutions: vmap's grouped convolution against a batched matmul and separate ones.

The first H200 lease (``results/cifar_pack_throughput_gpu.json``) found a
float32 pack of ResNet-20x2 runs slower than the same runs trained one after
another. In a packed step every convolution is ``jax.vmap`` of a convolution
over the runs' own kernels, which XLA lowers to one grouped convolution
(``feature_group_count`` = the number of runs). This script times, for the
convolution shapes of ResNet-20x2 at batch 128, one forward and backward
(gradients of the input and the kernel) of R runs' convolutions written three
ways:

* ``grouped``: ``jax.vmap`` of ``lax.conv_general_dilated`` (what a pack runs
  today);
* ``im2col``: each run's padded input as its kernel-size shifted copies side by
  side on the channel axis (:func:`safe_optax.vision.models.im2col_conv`, which
  the models use with ``conv_impl="im2col"``), then one batched matmul of
  ``[R, B*H*W, kh*kw*C]`` by ``[R, kh*kw*C, O]`` (more memory traffic, but one
  large GEMM that cuBLAS runs well);
* ``loop``: R plain convolutions in one program (a Python loop under ``jit``).

It prints milliseconds per formulation and each one's time over ``grouped``,
and writes JSON with the versions. Which formulation a packed step should use
on a GPU is what it decides; the three agree to rounding (the tests check).

  python -m benchmarks.perf.packed_conv --runs 1 3 15 --out benchmarks/perf/results/packed_conv.json
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from benchmarks.harness import run_record, summary, time_calls, timed, write_report
from safe_optax.vision import models

# ResNet-20x2's 3 x 3 convolutions at batch 128: (height = width, in = out channels) per stage
SHAPES = ((32, 32), (16, 64), (8, 128))
DIMENSIONS = ("NHWC", "HWIO", "NHWC")
FORMS = ("grouped", "im2col", "loop")


def conv(x: jax.Array, w: jax.Array) -> jax.Array:
  """One run's convolution: stride 1, ``SAME`` padding, NHWC input, HWIO kernel."""
  return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=DIMENSIONS)


def im2col_conv(x: jax.Array, w: jax.Array) -> jax.Array:
  """:func:`conv` as the library's im2col form (:func:`safe_optax.vision.models.im2col_conv`)."""
  return models.im2col_conv(x, w, (1, 1), "SAME",
                            dimension_numbers=lax.conv_dimension_numbers(x.shape, w.shape,
                                                                         DIMENSIONS))


def packed(form: str) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """R runs' convolutions, ``x: [R, B, H, W, C]`` by ``w: [R, kh, kw, C, O]``, written as ``form``."""
  if form == "grouped":
    return jax.vmap(conv)
  if form == "im2col":
    return jax.vmap(im2col_conv)
  if form == "loop":
    return lambda x, w: jnp.stack([conv(x[r], w[r]) for r in range(x.shape[0])])
  raise ValueError(f"form must be one of {FORMS}, got {form!r}")


def forward_backward(form: str) -> Callable:
  """The jitted loss, input gradient and kernel gradient of :func:`packed` ``(form)``."""
  def loss(x, w):
    y = packed(form)(x, w)
    return jnp.sum(jnp.square(y.astype(jnp.float32)))
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def time_form(form: str, x: jax.Array, w: jax.Array, steps: int, warmup: int) -> dict:
  fn = forward_backward(form)
  _, compile_s = timed(fn, x, w)
  return {"compile_s": compile_s, **summary(time_calls(fn, x, w, warmup=warmup, repeats=steps))}


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", nargs="+", type=int, default=[1, 3, 15])
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                      choices=["float32", "bfloat16"])
  parser.add_argument("--forms", nargs="+", default=list(FORMS), choices=FORMS)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--out", default="benchmarks/perf/results/packed_conv.json")
  args = parser.parse_args(argv)
  if any(r < 1 for r in args.runs) or args.batch < 1:
    parser.error(f"--runs and --batch take counts >= 1, got {args.runs} and {args.batch}")
  start = time.perf_counter()
  report = {**run_record(), "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "cells": []}
  rng = np.random.default_rng(0)
  print(f"{'dtype':>8} {'runs':>4} {'HxW':>5} {'C':>4} " +
        " ".join(f"{f + ' ms':>11}" for f in args.forms) + "  x grouped")
  for dtype in args.dtypes:
    for runs in args.runs:
      for size, channels in SHAPES:
        x = jnp.asarray(rng.standard_normal((runs, args.batch, size, size, channels)), dtype)
        w = jnp.asarray(0.05 * rng.standard_normal((runs, 3, 3, channels, channels)), dtype)
        cell = {"dtype": dtype, "runs": runs, "size": size, "channels": channels,
                "batch": args.batch, "forms": {}}
        for form in args.forms:
          cell["forms"][form] = time_form(form, x, w, args.steps, args.warmup)
        base = cell["forms"].get("grouped", {}).get("median_ms")
        ratios = {f: t["median_ms"] / base for f, t in cell["forms"].items()} if base else {}
        cell["ratio_to_grouped"] = ratios
        report["cells"].append(cell)
        print(f"{dtype:>8} {runs:>4} {size:>5} {channels:>4} " +
              " ".join(f"{cell['forms'][f]['median_ms']:11.3f}" for f in args.forms) + "  " +
              " ".join(f"{f}={r:.2f}" for f, r in ratios.items() if f != "grouped"), flush=True)
        write_report(report, args.out, start)


if __name__ == "__main__":
  main()
