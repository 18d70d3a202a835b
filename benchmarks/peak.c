/* --peak of benchmarks/kernel.py: twelve independent chains of 8-wide FMAs on registers, no memory (the
   script swaps in the 16-wide AVX-512 names where the CPU has them). */
#include <immintrin.h>
float fma_chains(long iters, int nthreads) {
    float out = 0.0f;
    #pragma omp parallel num_threads(nthreads) reduction(+:out)
    {
        const __m256 x = _mm256_set1_ps(0.9999f), y = _mm256_set1_ps(1e-4f);
        __m256 a[12];
        for (int j = 0; j < 12; j++) a[j] = _mm256_set1_ps(0.001f * j);
        for (long i = 0; i < iters; i++) {
            a[0] = _mm256_fmadd_ps(a[0], x, y); a[1] = _mm256_fmadd_ps(a[1], x, y); a[2] = _mm256_fmadd_ps(a[2], x, y);
            a[3] = _mm256_fmadd_ps(a[3], x, y); a[4] = _mm256_fmadd_ps(a[4], x, y); a[5] = _mm256_fmadd_ps(a[5], x, y);
            a[6] = _mm256_fmadd_ps(a[6], x, y); a[7] = _mm256_fmadd_ps(a[7], x, y); a[8] = _mm256_fmadd_ps(a[8], x, y);
            a[9] = _mm256_fmadd_ps(a[9], x, y); a[10] = _mm256_fmadd_ps(a[10], x, y);
            a[11] = _mm256_fmadd_ps(a[11], x, y);
        }
        for (int j = 0; j < 12; j++) out += a[j][0];
    }
    return out;
}
