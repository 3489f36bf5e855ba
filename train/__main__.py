from train.cli import main
from train.heap import exit_process

exit_process(main(exiting=True))
