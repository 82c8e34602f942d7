"""The `xagg` command. Thin: the logic lives in the modules it calls."""
from __future__ import annotations

import click

from xagg.cli.plan import CONTEXT, plan
from xagg.lab.cli import lab


@click.group(context_settings=CONTEXT)
def main():
    """xagg: gradient aggregation for data-parallel training, inside the kernel (XDP).

    \b
    Plan where a job's gradient goes:
      xagg plan --host w0=1gbit --host w1=1gbit --host a0=4gbit --host a1=1gbit
    Start with a virtual cluster on this machine (needs root):
      xagg lab up --workers 4 --rate 1gbit
      xagg lab exec w0 -- ping -c1 10.77.0.101
      xagg lab down
    """


main.add_command(plan)
main.add_command(lab)

if __name__ == "__main__":
    main()
