"""The course's benchmarks: each ``bench_*.py`` has ``main() -> Section``; ``run_all`` runs them all."""


class Section(str):
    """A benchmark's markdown, carrying the headline ratios it measured.

    It prints as plain markdown (so ``print(main())`` still works); ``run_all`` gathers every
    section's ``headlines`` into one summary table: rows of (comparison, ratio, how to read it),
    each ratio computed from numbers measured side by side in the same run.
    """

    def __new__(cls, text, headlines=()):
        section = super().__new__(cls, text)
        section.headlines = [tuple(h) for h in headlines]
        return section
