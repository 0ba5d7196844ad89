// `flce run`: the oracle (or any backend) from .npy files to .npy files.
#pragma once

namespace flce::cli {

int run_command(int argc, char** argv, int first);
const char* run_usage();

}  // namespace flce::cli
