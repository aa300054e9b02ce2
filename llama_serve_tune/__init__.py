"""The `llama-serve-tune` console command (cli.py): one entry over the serving app, the tuner and the benchmark
scripts. It sits above every other package (scripts -> tuning -> measure -> serving) and imports none of them:
each subcommand becomes the command line it stands for."""
