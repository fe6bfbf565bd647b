"""``vf_sums`` with its ``add`` tool server started by each episode (``Task.toolsets``) instead of once for the run.
Loaded by id: ``vf_sums_each``."""

import verifiers.v1 as vf
from vf_sums import ROWS, SumData, SumTask
from vf_sums.tools import Adder


class SumTaskOwnTools(SumTask):
    @classmethod
    def toolsets(cls, config):
        return [Adder(vf.ToolsetConfig())]


class SumEachTaskset(vf.Taskset[SumTaskOwnTools, vf.TasksetConfig]):
    def load(self):
        for row in ROWS:
            yield SumTaskOwnTools(SumData(prompt=row["question"], answer=row["answer"]), self.config.task)


__all__ = ["SumEachTaskset"]
