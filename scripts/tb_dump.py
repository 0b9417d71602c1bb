"""Prints the scalars of one TensorBoard run: python scripts/tb_dump.py lightning_logs/quickstart/version_0"""

import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator


def main(run_dir: str) -> None:
    events = EventAccumulator(run_dir)
    events.Reload()
    for tag in events.Tags()["scalars"]:
        print(tag, [round(e.value, 3) for e in events.Scalars(tag)])


if __name__ == "__main__":
    main(sys.argv[1])
