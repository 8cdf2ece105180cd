from boost_jax.train import main

main()
