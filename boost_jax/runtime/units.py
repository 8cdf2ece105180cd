"""Binary byte units, one definition for every module that prints or budgets memory."""

MIB = 2**20
GIB = 2**30
