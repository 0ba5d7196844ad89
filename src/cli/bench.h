// `flce bench`: times one pass of a generated problem and, in the same run,
// the GEMM that pass cannot avoid; prints one JSON line.
#pragma once

namespace flce::cli {

int bench_command(int argc, char** argv, int first);

}  // namespace flce::cli
