"""The `xagg` command, the product's door for people (xaggd and xagg-client
have their own, in their rooms).

    main.py   the `xagg` group: `xagg plan` here, `xagg lab ...` from the lab room
    plan.py   `xagg plan`: the planner's inputs (a file's, flags, a lab's, a probe's) and its plan

Imports the wire (the planner), the client (probing from this host) and the
lab (its commands, and a lab's figures for `xagg plan --lab`).
"""
