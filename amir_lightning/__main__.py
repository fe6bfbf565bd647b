"""``python -m amir_lightning`` is the ``amir`` command."""

from amir_lightning.cli import main

main()
