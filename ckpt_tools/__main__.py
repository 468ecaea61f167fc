from ckpt_tools.runtime.lifeline import tie_to_launcher

tie_to_launcher()  # under torchrun: end with the launcher, even if it dies while we start up

from ckpt_tools.cli.main import main  # noqa: E402

main(prog_name="ckpt")
