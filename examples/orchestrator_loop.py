"""An RL orchestrator that owns its loop: rollouts on SGLang, new weights switched in between tasks.

The engine keeps serving while the next version downloads and verifies (poll); the only pause is
the switch (apply), and it happens exactly where the orchestrator says: between two tasks.

    python examples/orchestrator_loop.py s3://bucket/run1 /models/current \\
        --engine-url http://127.0.0.1:30000 --tasks 100 \\
        --storage-options '{"endpoint_url": "http://minio:9000"}'
"""

from __future__ import annotations

import argparse
import json
import logging

import requests

from deltafs.engines import make_engine
from deltafs.errors import DeltafsError
from deltafs.watch import Subscriber

log = logging.getLogger("orchestrator")


def rollout(engine_url: str, task: int) -> dict:
    """One task: a generation request; the answer says which weight version produced it."""
    body = {"text": f"task {task}", "sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
    resp = requests.post(f"{engine_url}/generate", json=body, timeout=600)
    resp.raise_for_status()
    return resp.json()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store")
    parser.add_argument("dest")
    parser.add_argument("--engine-url", required=True)
    parser.add_argument("--tasks", type=int, default=10)
    parser.add_argument("--host-id", default=None)
    parser.add_argument("--storage-options", default=None, help="JSON object of fsspec options")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    engine = make_engine("sglang", args.engine_url, pause_mode="retract")
    sub = Subscriber(args.store, args.dest, engine, host_id=args.host_id,
                     storage_options=json.loads(args.storage_options) if args.storage_options else None)
    sub.start()
    for task in range(args.tasks):
        try:
            sub.poll()  # stage the newest version, if any, while the engine serves
        except DeltafsError as exc:
            log.warning("could not stage a new version (still serving %s): %s",
                            sub.served.version if sub.served else "?", exc)
        answer = rollout(args.engine_url, task)
        print(json.dumps({"task": task, "weight_version": answer["meta_info"]["weight_version"]}), flush=True)
        # Task boundary: switch now if something is staged. On failure the engine is back on the
        # previous verified version and the staged one is tried again at the next boundary.
        try:
            sub.apply()
        except DeltafsError as exc:
            log.error("switch failed, still serving %s: %s", sub.served.version if sub.served else "?", exc)
    sub.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
