"""Run OpenFGL's FedAvg once (one seed) and print one JSON line with its accuracy and wall times.

Runs with the OpenFGL venv's python (see setup_openfgl.sh), never with fglit's:

    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 benchmarks/.venv-openfgl/bin/python benchmarks/_openfgl_fedavg.py --seed 0

The installed openfgl package is used as it is; this script only builds its `args`, lays out the
offline data, drives `FGLTrainer` and listens to the per-round evaluation through the trainer's logger.

Data layout OpenFGL expects (read from openfgl/data/*.py):
  <root>/global/subgraph_fl/Cora/raw/ind.cora.*        raw Planetoid files (PyG Planetoid(root=<root>/global/subgraph_fl))
  <root>/global/subgraph_fl/Cora/processed/            written by PyG on first load
  <root>/distrib/subgraph_fl_louvain_1_Cora_client_10/   OpenFGL's cached partition + per-client splits
With --fresh (default) the run's root is wiped first, so partitioning and splitting are redone and timed.

Stdout carries exactly one JSON line; OpenFGL's own chatter goes to <root>/openfgl.log.
"""
import argparse
import contextlib
import json
import os
import platform
import shutil
import sys
import time

RAW_FILES = [f"ind.cora.{s}" for s in ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")]


def cli():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raw", default="/work/shared/datasets/Cora/raw", help="folder holding ind.cora.* (read only)")
    p.add_argument("--work", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "work", "openfgl-data"))
    p.add_argument("--no-fresh", dest="fresh", action="store_false",
                   help="reuse the partition/split a previous --keep-data run left under the work folder")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--evaluation-mode", default="local_model_on_local_data",
                   help="OpenFGL evaluation_mode (its default: each client's model right after local training, on its own split)")
    p.add_argument("--keep-data", action="store_true",
                   help="keep the run's processed dataset and partition (about 30 MB a run); by default only openfgl.log stays")
    p.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave torch's default)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="OpenFGL's use_cuda (its GPU 0) or the CPU")
    return p.parse_args()


def lay_out_data(raw: str, root: str, fresh: bool) -> None:
    "Copy the raw Planetoid files into <root>/global/subgraph_fl/Cora/raw (OpenFGL cannot download)."
    if fresh and os.path.isdir(root):
        shutil.rmtree(root)
    dst = os.path.join(root, "global", "subgraph_fl", "Cora", "raw")
    os.makedirs(dst, exist_ok=True)
    for name in RAW_FILES:
        src = os.path.join(raw, name)
        if not os.path.isfile(src):
            raise FileNotFoundError(f"missing raw Cora file {src}")
        if not os.path.isfile(os.path.join(dst, name)):
            shutil.copyfile(src, os.path.join(dst, name))


def openfgl_args(o, root: str):
    "OpenFGL's own argparse namespace, built from its parser with an explicit argument list."
    sys_argv, sys.argv = sys.argv, sys.argv[:1]  # openfgl.config parses sys.argv at import: keep ours away from it
    try:
        from openfgl import config
    finally:
        sys.argv = sys_argv
    argv = ["--root", root, "--scenario", "subgraph_fl", "--dataset", "Cora",
            "--simulation_mode", "subgraph_fl_louvain",
            "--fl_algorithm", "fedavg", "--num_clients", str(o.clients), "--client_frac", "1.0",
            "--num_rounds", str(o.rounds), "--num_epochs", str(o.epochs),
            "--task", "node_cls", "--train_val_test", "default_split",
            "--model", "gcn", "--num_layers", str(o.layers), "--hid_dim", str(o.hidden),
            "--lr", str(o.lr), "--weight_decay", str(o.weight_decay), "--dropout", str(o.dropout), "--optim", "adam",
            "--metrics", "accuracy", "--evaluation_mode", o.evaluation_mode,
            "--seed", str(o.seed), "--gpuid", "0"]
    args = config.parser.parse_args(argv)
    args.use_cuda = o.device == "cuda"  # its flag is type=bool (any string is True): set it directly
    args.debug = False     # no pickle logs
    # Louvain knobs left at OpenFGL's defaults (resolution 1, delta 20). Not passed on the argument list on purpose:
    # --louvain_delta is declared type=float, and a float delta makes subgraph_fl_louvain crash (it slices with it).
    assert args.louvain_resolution == 1 and args.louvain_delta == 20 and isinstance(args.louvain_delta, int)
    return args


def main():
    o = cli()
    os.environ.setdefault("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")  # OpenFGL torch.load()s pickled Data objects
    t_import = time.perf_counter()
    import torch
    import torch_geometric
    if o.threads:
        torch.set_num_threads(o.threads)
    from openfgl.flcore.trainer import FGLTrainer
    from openfgl.utils.basic_utils import seed_everything
    import openfgl
    t_import = time.perf_counter() - t_import

    root = os.path.join(o.work, f"seed{o.seed}")
    lay_out_data(o.raw, root, o.fresh)
    args = openfgl_args(o, root)

    history = []
    log_path = os.path.join(root, "openfgl.log")
    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        seed_everything(args.seed)  # OpenFGL's own seeding helper (random, numpy, torch)
        t0 = time.perf_counter()
        trainer = FGLTrainer(args)  # global dataset, Louvain partition, per-client splits, models
        t1 = time.perf_counter()
        # The trainer hands every round's evaluation_result to logger.add_log (a no-op unless debug):
        # listen there to keep the per-round curve without touching the package.
        trainer.logger.add_log = lambda res: history.append(dict(res))
        trainer.train()
        t2 = time.perf_counter()

    best = trainer.evaluation_result
    sizes = [c.task.num_samples for c in trainer.clients]
    edges = [int(c.task.data.edge_index.shape[1]) // 2 for c in trainer.clients]
    n_train = [int(c.task.train_mask.sum()) for c in trainer.clients]
    n_val = [int(c.task.val_mask.sum()) for c in trainer.clients]
    n_test = [int(c.task.test_mask.sum()) for c in trainer.clients]
    g = trainer.server.task.data
    out = {
        "library": "openfgl",
        "openfgl_version": _version("openfgl-lib"),
        "seed": o.seed,
        "accuracy": float(best["best_test_accuracy"]),       # test accuracy at the round of best validation accuracy
        "best_val_accuracy": float(best["best_val_accuracy"]),
        "best_round": int(best["best_round"]),
        "final_test_accuracy": float(history[-1]["current_test_accuracy"]) if history else None,
        "final_val_accuracy": float(history[-1]["current_val_accuracy"]) if history else None,
        "train_time_s": t2 - t1,         # trainer.train(): rounds of local training, aggregation, per-round evaluation
        "setup_time_s": t1 - t0,         # FGLTrainer(args): dataset processing, Louvain partition, splits, models
        "total_time_s": t2 - t0,
        "import_time_s": t_import,
        "evaluation_mode": args.evaluation_mode,
        "history": [[h["current_round"], round(float(h["current_val_accuracy"]), 5),
                     round(float(h["current_test_accuracy"]), 5)] for h in history],
        "partition": {
            "client_nodes": sizes, "client_edges": edges,
            "train": n_train, "val": n_val, "test": n_test,
            "nodes_total": int(g.num_nodes), "edges_total": int(g.edge_index.shape[1]) // 2,
            "edges_kept": int(sum(edges)),
        },
        "args": {k: v for k, v in sorted(vars(args).items()) if isinstance(v, (int, float, str, bool, list))},
        "torch": torch.__version__, "torch_geometric": torch_geometric.__version__,
        "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
        "device": f"cuda:{torch.cuda.get_device_name(0)}" if args.use_cuda else "cpu",
        "log": log_path,
    }
    if not o.keep_data:
        for sub in ("global", "distrib"):
            shutil.rmtree(os.path.join(root, sub), ignore_errors=True)
    print(json.dumps(out), flush=True)


def _version(dist: str):
    from importlib.metadata import version, PackageNotFoundError
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    main()
