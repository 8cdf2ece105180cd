"""The layout planner behind `python -m boost_jax.plan` (its command line is boost_jax/plan.py): which
parallel layout to run, with memory and time predicted before a GPU is rented. layouts.py
enumerates and checks the layouts, price.py prices them (cached compiles, run on worker processes
by workers.py), search.py ranks them (`rank_layouts`), recipe.py writes the winner as a config."""
