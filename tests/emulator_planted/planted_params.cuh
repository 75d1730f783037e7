// planted_params.cuh -- the parameters of every planted kernel in this folder
// (tests/test_emulator.py's PLANTED_DTYPE is its NumPy twin); included after
// ptx.cuh, which provides the fixed-width integer types.
#pragma once

struct PlantedParams {
    const float* in;
    float* out;
    int32_t* ticket;
    int32_t n;
    int32_t arg;
};
