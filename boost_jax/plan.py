"""`python -m boost_jax.plan ...`: the layout planner's command (its code is the `boost_jax.planner` package)."""

from boost_jax.planner.__main__ import main

if __name__ == "__main__":
    main()
