from ddpo_tpu.train import main

main()
