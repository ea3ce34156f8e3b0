"""The failure domain of one request. When a step raises, the engine rolls it back (every job of the step is
requeued to be recomputed from its tokens so far, which gives the outputs it would give alone; nothing the step
would have published is kept) and isolates the cause by trials: first the step's jobs that were already
running, then its new admissions; a trial group that fails again is halved, and a job that fails alone is the
culprit: it alone is failed, with the error as its reason. While a trial runs only its jobs are scheduled. A job
passes its trial once it has progressed beyond where the failed step took it (its ``progress()`` exceeds the
mark taken when it joined that step), or has finished."""
from __future__ import annotations

from gdnserve.engine.scheduling.request import Job


class Isolation:
    def __init__(self) -> None:
        self.groups: list[list[Job]] = []          # trial groups, the first one running
        self.marks: dict[Job, tuple[int, int]] = {}

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def allowed(self) -> set[Job] | None:
        return set(self.groups[0]) if self.groups else None

    def start(self, jobs: list[Job], admitted: list[Job], marks: dict[Job, tuple[int, int]]) -> None:
        """A step of ``jobs`` failed outside any trial."""
        old = [j for j in jobs if j not in admitted]
        new = [j for j in jobs if j in admitted]
        self.groups = [g for g in (old, new) if g]
        self.marks = {j: marks.get(j, (0, 0)) for j in jobs}

    def failed(self, marks: dict[Job, tuple[int, int]]) -> Job | None:
        """The running trial's step failed: its job if it ran alone (the culprit), else the group is halved."""
        g = self.groups.pop(0)
        for j in g:
            self.marks[j] = min(self.marks.get(j, (0, 0)), marks.get(j, (0, 0)))
        if len(g) == 1:
            self.marks.pop(g[0], None)
            return g[0]
        h = len(g) // 2
        self.groups[:0] = [g[:h], g[h:]]
        return None

    def passed(self) -> None:
        """After a successful step: jobs of the running trial that got past their mark leave it."""
        if not self.groups:
            return
        g = self.groups[0]
        g[:] = [j for j in g if not (j.finished or j.progress() > self.marks.get(j, (0, 0)))]
        self._settle()

    def forget(self, job: Job) -> None:
        for g in self.groups:
            if job in g:
                g.remove(job)
        self.marks.pop(job, None)
        self._settle()

    def give_up(self) -> None:
        """Nothing of the trial can run (an empty step): stop isolating."""
        self.groups, self.marks = [], {}

    def _settle(self) -> None:
        while self.groups and not self.groups[0]:
            self.groups.pop(0)
        if not self.groups:
            self.marks = {}
