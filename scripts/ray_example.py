#!/usr/bin/env python
"""rocketkv's Python API inside your own Ray Data pipeline: an actor class holds one model.

    pip install 'rocketkv[ray]'
    python scripts/ray_example.py --docs FOLDER --question "Who signs it?" --out answers/ \
        [--model smollm2-135m] [--address auto] [--actors 2] [--actor-cpus 1] [--cache-dir kv/]

Reads every file of FOLDER (or the one file named; `ray.data.read_binary_files`), and in `--actors` actors (keep
actors × `--actor-cpus` below the cluster's CPUs: the file reads need one too), each of
which loaded the model once: ingests each document once into `--cache-dir` (a shared path on a
real cluster; a file already there is reused), asks every `--question`, and writes one row per
answer with `Dataset.write_json` into `--out`. A document rocketkv refuses gives a row with
`error` set instead of failing the pipeline. Without `--address` a local Ray instance is started.
docs/batch.md explains the cluster set-up; `rocketkv batch --ray` is the ready-made version.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import ray
import ray.data


class Answerer:
    """Ray Data actor: `__init__` loads the model once; `__call__` answers a batch of documents."""

    def __init__(self, model: str, cache_dir: str, questions: list[str], token_budget: int, max_new_tokens: int):
        from rocketkv_cli import RocketKV

        self.rk = RocketKV.load(model, device="cpu")
        self.cache_dir, self.questions = Path(cache_dir), questions
        self.token_budget, self.max_new_tokens = token_budget, max_new_tokens

    def cache_for(self, text: str):
        """The document's cache: `CACHE_DIR/<sha256 of the text and settings>.kv`, ingested once."""
        key = hashlib.sha256(f"{self.token_budget}:{self.max_new_tokens}:{text}".encode()).hexdigest()
        path = self.cache_dir / f"{key}.kv"
        if path.exists():
            return self.rk.open(path), path
        done = self.rk.ingest(text=text, output=path, force=True, token_budget=self.token_budget,
                              max_new_tokens=self.max_new_tokens)  # fmt: skip
        return done.cache, path

    def __call__(self, batch: dict) -> dict:
        from rocketkv_cli.errors import RocketKVError

        out: dict[str, list] = {"path": [], "question": [], "answer": [], "cache": [], "error": []}

        def add(path, question, answer="", cache="", error=""):
            for key, value in zip(out, (path, question, answer, cache, error)):
                out[key].append(value)

        for path, data in zip(batch["path"], batch["bytes"]):
            try:
                cache, kv = self.cache_for(bytes(data).decode("utf-8"))
                for ans in self.rk.ask(cache, self.questions, max_new_tokens=self.max_new_tokens):
                    add(str(path), ans.question, ans.text, str(kv))
            except (RocketKVError, UnicodeDecodeError) as exc:
                add(str(path), "", error=str(exc))
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", required=True, help="a folder of text documents, or one file")
    parser.add_argument("--question", action="append", required=True, help="a question (repeat for more)")
    parser.add_argument("--out", required=True, help="output folder for Ray's JSON files")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--address", default=None, help="Ray cluster address, or auto (default: start one)")
    parser.add_argument("--actors", type=int, default=2, help="actors, each holding a model")
    parser.add_argument("--actor-cpus", type=float, default=1.0,
                        help="CPUs per actor; leave Ray Data a CPU for its read tasks")  # fmt: skip
    parser.add_argument("--cache-dir", default="kv-cache", help="where .kv files go (shared on a cluster)")
    parser.add_argument("--budget", type=int, default=512, help="token budget")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    ray.init(address=args.address, include_dashboard=False)
    Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
    docs = ray.data.read_binary_files(str(Path(args.docs).resolve()), include_paths=True)
    answers = docs.map_batches(
        Answerer,
        fn_constructor_kwargs={"model": args.model, "cache_dir": str(Path(args.cache_dir).resolve()),
                               "questions": args.question, "token_budget": args.budget,
                               "max_new_tokens": args.max_new_tokens},
        batch_size=4,
        compute=ray.data.ActorPoolStrategy(size=args.actors),
        num_cpus=args.actor_cpus,
    )  # fmt: skip
    answers.write_json(str(Path(args.out).resolve()))
    print(f"wrote the answers to {args.out}")


if __name__ == "__main__":
    main()
