"""A verifiers (0.4) taskset whose tools return what the policy cannot read whole: text that is no valid Unicode
(``garbled``: a lone surrogate, as bytes decoded with ``surrogateescape`` give) and text of many megabytes
(``dump``), served once for the run (``vf_results.tools``). Loaded by id: ``vf_results``."""

import verifiers.v1 as vf
from vf_sums import ROWS, SumData, SumTask

from vf_results.tools import Results


class ResultsTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    @classmethod
    def toolsets(cls, config):
        return [Results(vf.ToolsetConfig())]

    def load(self):
        for row in ROWS:
            yield SumTask(SumData(prompt=row["question"], answer=row["answer"]), self.config.task)


__all__ = ["ResultsTaskset"]
