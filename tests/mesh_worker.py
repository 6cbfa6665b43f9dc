"""One process of a mesh, for tests/test_mesh.py: `python mesh_worker.py PLAN RESULT`.

PLAN is a pickled dict: `index`, `count`, `directory`, `job`, `timeout`, and optionally `config` and `batches` (this
process's share of each step), `threads`, `devices`, `arena`, `save` (a path every process saves to after the
steps), `die_after` (exit at once after that many steps, as a killed process would), `stall_after` (sleep `stall` seconds before that step),
`other_executor` (make the trainer on an executor
the mesh did not join with), `second_config` (make a second trainer after the first, and step it once with the
first batch, after the first trainer's steps, or before them with `second_first`), `gather` (parts this process gathers once joined) and `gather_between` (parts it gathers after each step). RESULT receives a pickled
dict: `mesh` (its index, count and repr), `gathered` (what each gather answered), `stats` (one dict per step, or `refused` with the message of a step
refused as bad input), `embeddings`, `weights` and `seconds`, or `error` (the class name and message of
what uform raised), `waited` (how long the verb that raised it ran) and `seconds`, the time spent until then.
"""
import contextlib
import os
import pickle
import sys
import time

import numpy as np

import uform


CALLED = [0.0]  # when the last verb was called, so a failure tells how long that verb waited


def run(plan):
    steps, embeddings = [], []
    with uform.Executor.for_ram(threads=plan.get("threads", 1), devices=plan.get("devices", 1)) as executor, \
            uform.Mesh.bootstrap(executor, plan["index"], plan["count"], plan["directory"], plan["job"],
                                 timeout=plan["timeout"]) as mesh:
        joined = (mesh.host_domain_index, mesh.host_domain_count, repr(mesh))
        gathered = [mesh.gather(part) for part in plan.get("gather", [])]
        if "config" not in plan:
            return dict(stats=[], embeddings=[], weights=None, mesh=joined, gathered=gathered)
        if plan.get("other_executor"):  # a trainer made on an executor the mesh did not join with
            executor = uform.Executor.for_ram(threads=1)
        with uform.Trainer.init_ram(executor, plan["config"], mesh) as trainer, \
                (uform.Trainer.init_ram(executor, plan["second_config"], mesh) if plan.get("second_config")
                 else contextlib.nullcontext()) as second:
            if second is not None and plan.get("second_first"):
                second.step(plan["batches"][0])
            for number, batch in enumerate(plan["batches"]):
                if plan.get("die_after") == number:
                    os._exit(3)
                if plan.get("stall_after") == number:  # alive, but silent past the mesh's timeout
                    time.sleep(plan["stall"])
                try:
                    CALLED[0] = time.monotonic()
                    stepped = trainer.step(batch, dict(arena=uform.Arena()) if plan.get("arena") else None)
                except uform.InvalidArgument as refused:  # every process refuses a share any one refuses
                    steps.append(dict(refused=str(refused)))
                    embeddings.append(None)
                    continue
                steps.append(dict(stepped.stats))
                embeddings.append(np.array(stepped.embeddings) if plan.get("arena") else None)
                gathered += [mesh.gather(part) for part in plan.get("gather_between", [])]
            if second is not None and not plan.get("second_first"):
                second.step(plan["batches"][0])
            if plan.get("save"):
                trainer.save(plan["save"])
            return dict(stats=steps, embeddings=embeddings, weights=trainer._weights(), mesh=joined, gathered=gathered)


def main():
    with open(sys.argv[1], "rb") as file:
        plan = pickle.load(file)
    start = time.monotonic()
    try:
        result = run(plan)
    except uform.Error as error:
        result = dict(error=(type(error).__name__, str(error)), waited=time.monotonic() - (CALLED[0] or start))
    result["seconds"] = time.monotonic() - start
    with open(sys.argv[2] + ".partial", "wb") as file:
        pickle.dump(result, file)
    os.replace(sys.argv[2] + ".partial", sys.argv[2])


if __name__ == "__main__":
    main()
