from nemo_fp8rl.audit.cli import main

main()
