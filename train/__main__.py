import sys

from train.stop_signals import hold_early

hold_early()  # before the imports below: a stop arriving while they run is held, not fatal

from train.cli import main  # noqa: E402

sys.exit(main(exiting=True))
