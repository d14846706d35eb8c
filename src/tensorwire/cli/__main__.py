"""``python -m tensorwire.cli ...``: the ``tensorwire`` command."""

from tensorwire.cli.app import main

main(prog_name="tensorwire")
