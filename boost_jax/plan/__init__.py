"""`python -m boost_jax.plan`: which parallel layout to run, with memory and time predicted before a
GPU is rented. layouts.py enumerates and checks the layouts, price.py prices them (cached
compiles), search.py ranks them, recipe.py writes the winner as a config. (Not to be confused with
`boost_jax.parallel.plan`, the Plan object a model runs under.)"""
