"""The layout planner behind `python -m boost_jax.plan`: which parallel layout to run, with memory
and time predicted before a GPU is rented. layouts.py enumerates and checks the layouts, price.py
prices them (cached compiles), search.py ranks them, recipe.py writes the winner as a config."""
