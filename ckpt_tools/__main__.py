from ckpt_tools.cli.main import main

main(prog_name="ckpt")
