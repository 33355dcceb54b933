// TensorRT plugin "DFlashKVInject" (version "1", namespace "dflash_trt"): the fused KV injection of
// dflash_trt/ops/csrc/kv_inject.cu (DFlash paper sec. 3.2) as one layer of a TensorRT 10 engine.
//
// An IPluginV3 with the IPluginV3OneCore / IPluginV3OneBuildV2 / IPluginV3OneRuntime capabilities. Its enqueue
// calls the kernel's C ABI `dflash_kv_inject_guarded` with its bindings and stream; nothing else runs on the GPU.
// Inputs, in the order of that ABI (T = float32, float16 or bfloat16, all linear/contiguous):
//
//   0 kv        [n, c, L * 2 * H * D] T       per token, layer l's K (H * D values) then its V
//   1 k_norm    [L, D] T                      each layer's k_norm weight
//   2 cos       [n, c, D] float32             RoPE of each token's position
//   3 sin       [n, c, D] float32
//   4 cache     [2, L, B, H, cap, D] T        the drafter's context cache
//   5 rows      [n] int64                     the cache row of each sequence
//   6 positions [n, c] int64                  the slot (absolute position) of each token, < cap
//
// Output 0 is the updated cache, input 4's shape and dtype. When the output's device address is the cache's (the
// application binds both to one buffer, or TensorRT aliases them) enqueue writes in place; otherwise it first copies
// the cache into the output (cudaMemcpyAsync on the same stream) and injects there.
//
// A token whose row is outside [0, B) or whose position is outside [0, cap) is skipped (nothing written for it),
// where the torch op's entry point `dflash_kv_inject` stops with a device-side assertion as torch's indexing kernels
// do: TensorRT's builder may time the plugin on random inputs and trtexec fills inputs with random data, and a
// device-side assertion leaves a sticky error that kills the CUDA context.
//
// Fields:
//   eps          kFLOAT32, one value, required: k_norm's epsilon, the drafter config's rms_norm_eps. No default,
//                because it differs between models (1e-5, 1e-6) and a wrong one changes K.
//   alias_cache  kINT32, one value, 0 or 1, default 0: 1 declares output 0 aliased to input 4 (getAliasedInput),
//                which needs PreviewFeature::kALIASED_PLUGIN_IO_10_03 on the builder config (reportedly the build
//                fails without it); 0 declares no aliasing (-1).
//
// TensorRT finds the creator through the two C entry points at the end (`getCreators`, `setLoggerFinder`) that
// IPluginRegistry::loadLibrary / `trtexec --dynamicPlugins` look up; the library does not link libnvinfer
// (REGISTER_TENSORRT_PLUGIN would need its getPluginRegistry). Problems are reported through the execution
// context's error recorder once attached, else the logger TensorRT hands to setLoggerFinder, else stderr.
#include <NvInferRuntime.h>
#include <cuda_runtime_api.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>

extern "C" int dflash_kv_inject_guarded(int dtype, const void* kv, const void* k_norm, float eps, const float* cos,
                                        const float* sin, void* cache, const int64_t* rows, const int64_t* positions,
                                        int64_t n, int64_t c, int64_t L, int64_t B, int64_t H, int64_t cap, int64_t D,
                                        void* stream);
extern "C" const char* dflash_cuda_error_string(int code);

#define DFLASH_EXPORT __attribute__((visibility("default")))

namespace {

using namespace nvinfer1;

constexpr char const* kNAME = "DFlashKVInject";
constexpr char const* kVERSION = "1";
constexpr char const* kNAMESPACE = "dflash_trt";
enum Input : int32_t { kKV, kKNORM, kCOS, kSIN, kCACHE, kROWS, kPOSITIONS, kNB_INPUTS };
constexpr char const* kINPUT_NAMES[kNB_INPUTS] = {"kv", "k_norm", "cos", "sin", "cache", "rows", "positions"};

std::atomic<ILoggerFinder*> gLoggerFinder{nullptr};

// One message, to `recorder` (with `code`) if there is one, else TensorRT's logger, else stderr; prefixed with the
// plugin name. kINVALID_ARGUMENT for a shape, type or field problem, kFAILED_EXECUTION for a CUDA failure.
void report(IErrorRecorder* recorder, ErrorCode code, std::string const& what) noexcept {
  try {
    std::string const msg = std::string(kNAME) + ": " + what;
    if (recorder != nullptr) {
      recorder->reportError(code, msg.c_str());
      return;
    }
    ILoggerFinder* finder = gLoggerFinder.load();
    ILogger* logger = finder != nullptr ? finder->findLogger() : nullptr;
    if (logger != nullptr)
      logger->log(ILogger::Severity::kERROR, msg.c_str());
    else
      std::fprintf(stderr, "%s\n", msg.c_str());
  } catch (...) {  // std::string allocation: nothing left to report with
  }
}

std::string dims_str(Dims const& d) {
  std::string s = "[";
  for (int32_t i = 0; i < d.nbDims; ++i) s += (i ? ", " : "") + std::to_string(d.d[i]);
  return s + "]";
}

// `dflash_kv_inject`'s dtype code of a TensorRT type, -1 for a type the kernel does not take.
int dtype_code(DataType t) {
  switch (t) {
    case DataType::kFLOAT: return 0;
    case DataType::kHALF: return 1;
    case DataType::kBF16: return 2;
    default: return -1;
  }
}

int64_t volume(Dims const& d) {
  int64_t v = 1;
  for (int32_t i = 0; i < d.nbDims; ++i) v *= d.d[i];
  return v;
}

// The inputs' shapes against each other: "" if they fit (or cannot be judged yet), else what is wrong. A dimension
// below 0 is unknown (a build-time wildcard) and is only checked once known; `exact` (onShapeChange, enqueue)
// requires every dimension, and the kernel's own limits, which a wildcard could still break or meet.
std::string check_shapes(Dims const* in, bool exact) {
  Dims const& cache = in[kCACHE];
  if (cache.nbDims != 6) return "cache must be [2, L, B, H, cap, D], got " + dims_str(cache);
  int32_t const ranks[kNB_INPUTS] = {3, 2, 3, 3, 6, 1, 2};
  for (int32_t i = 0; i < kNB_INPUTS; ++i)
    if (in[i].nbDims != ranks[i])
      return std::string(kINPUT_NAMES[i]) + " must have rank " + std::to_string(ranks[i]) + ", got " +
             dims_str(in[i]);
  int64_t const L = cache.d[1], H = cache.d[3], D = cache.d[5];
  int64_t const n = in[kPOSITIONS].d[0], c = in[kPOSITIONS].d[1];
  auto known = [](int64_t x) { return x >= 0; };
  auto differ = [&](int64_t a, int64_t b) { return known(a) && known(b) && a != b; };
  if (known(cache.d[0]) && cache.d[0] != 2) return "cache must be [2, L, B, H, cap, D], got " + dims_str(cache);
  if (known(D) && D % 2 != 0) return "head_dim D must be even (RoPE pairs), got cache " + dims_str(cache);
  int64_t const kv_width = known(L) && known(H) && known(D) ? L * 2 * H * D : -1;
  if (differ(in[kKV].d[2], kv_width))
    return "kv's last dimension must be L * 2 * H * D = " + std::to_string(kv_width) + " (cache " + dims_str(cache) +
           "), got kv " + dims_str(in[kKV]);
  if (differ(in[kKNORM].d[0], L) || differ(in[kKNORM].d[1], D))
    return "k_norm must be [L, D] of cache " + dims_str(cache) + ", got " + dims_str(in[kKNORM]);
  for (int32_t i : {kKV, kCOS, kSIN})
    if (differ(in[i].d[0], n) || differ(in[i].d[1], c))
      return std::string(kINPUT_NAMES[i]) + " must start with positions' [n, c] " + dims_str(in[kPOSITIONS]) +
             ", got " + dims_str(in[i]);
  for (int32_t i : {kCOS, kSIN})
    if (differ(in[i].d[2], D))
      return std::string(kINPUT_NAMES[i]) + " must be [n, c, D] with D = " + std::to_string(D) + ", got " +
             dims_str(in[i]);
  if (differ(in[kROWS].d[0], n))
    return "rows must be [n] with n = " + std::to_string(n) + " (positions' first dimension), got " +
           dims_str(in[kROWS]);
  if (!exact) return "";
  for (int32_t i = 0; i < kNB_INPUTS; ++i)
    for (int32_t k = 0; k < in[i].nbDims; ++k)
      if (in[i].d[k] < 0) return std::string(kINPUT_NAMES[i]) + " has an unknown dimension: " + dims_str(in[i]);
  if (L <= 0) return "the number of layers L must be > 0, got cache " + dims_str(cache);
  if (H <= 0) return "the number of KV heads H must be > 0, got cache " + dims_str(cache);
  if (D <= 0) return "head_dim D must be > 0, got cache " + dims_str(cache);
  if (n * c > 0 && cache.d[2] <= 0)
    return "the cache's rows B must be > 0 when there are tokens (positions " + dims_str(in[kPOSITIONS]) +
           "), got cache " + dims_str(cache);
  if (n * c > 0 && cache.d[4] <= 0)
    return "the cache's capacity cap must be > 0 when there are tokens (positions " + dims_str(in[kPOSITIONS]) +
           "), got cache " + dims_str(cache);
  if (D > 2048 || L > 65535 || H > 65535 || n * c > 2147483647LL)
    return "the kernel takes head_dim <= 2048, <= 65535 layers and KV heads and < 2^31 tokens, got cache " +
           dims_str(cache) + " and positions " + dims_str(in[kPOSITIONS]);
  return "";
}

class KVInjectPlugin final : public IPluginV3,
                             public IPluginV3OneCore,
                             public IPluginV3OneBuildV2,
                             public IPluginV3OneRuntime {
 public:
  KVInjectPlugin(float eps, int32_t alias_cache) : mEps(eps), mAliasCache(alias_cache) {}
  // Not the error recorder: a clone (of an attached plugin too) reports to the logger until attachToContext gives
  // it its own context's recorder, which it does not own beyond that context.
  KVInjectPlugin(KVInjectPlugin const& other) : mEps(other.mEps), mAliasCache(other.mAliasCache) {}

  // IPluginV3
  IPluginCapability* getCapabilityInterface(PluginCapabilityType type) noexcept override {
    switch (type) {
      case PluginCapabilityType::kCORE: return static_cast<IPluginV3OneCore*>(this);
      case PluginCapabilityType::kBUILD: return static_cast<IPluginV3OneBuildV2*>(this);
      case PluginCapabilityType::kRUNTIME: return static_cast<IPluginV3OneRuntime*>(this);
    }
    return nullptr;
  }
  IPluginV3* clone() noexcept override {
    try {
      return new KVInjectPlugin(*this);
    } catch (...) {
      return nullptr;
    }
  }

  // IPluginV3OneCore
  AsciiChar const* getPluginName() const noexcept override { return kNAME; }
  AsciiChar const* getPluginVersion() const noexcept override { return kVERSION; }
  AsciiChar const* getPluginNamespace() const noexcept override { return kNAMESPACE; }

  // IPluginV3OneBuild(V2)
  int32_t getNbOutputs() const noexcept override { return 1; }

  int32_t getOutputDataTypes(DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes,
                             int32_t nbInputs) const noexcept override {
    if (nbInputs != kNB_INPUTS || nbOutputs != 1) return fail_io_count(nbInputs, nbOutputs);
    outputTypes[0] = inputTypes[kCACHE];
    return 0;
  }

  // The output is the cache: input 4's dimensions, the same expressions (no IExprBuilder call).
  int32_t getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
                          int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs,
                          IExprBuilder& /*exprBuilder*/) noexcept override {
    if (nbInputs != kNB_INPUTS || nbOutputs != 1) return fail_io_count(nbInputs, nbOutputs);
    if (inputs[kCACHE].nbDims != 6) {
      try {
        report(mRecorder, ErrorCode::kINVALID_ARGUMENT,
               "cache must be [2, L, B, H, cap, D], got rank " + std::to_string(inputs[kCACHE].nbDims));
      } catch (...) {
      }
      return -1;
    }
    outputs[0] = inputs[kCACHE];
    return 0;
  }

  // kv, k_norm, cache and the output share T (float32 / float16 / bfloat16); cos, sin float32; rows, positions
  // int64; all linear. Decides position `pos` from inOut[0..pos] only, as TensorRT requires.
  bool supportsFormatCombination(int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
                                 int32_t nbOutputs) noexcept override {
    if (nbInputs != kNB_INPUTS || nbOutputs != 1 || pos < 0 || pos > kNB_INPUTS) return false;
    PluginTensorDesc const& d = inOut[pos].desc;
    if (d.format != TensorFormat::kLINEAR) return false;
    switch (pos) {
      case kKV: return dtype_code(d.type) >= 0;
      case kCOS:
      case kSIN: return d.type == DataType::kFLOAT;
      case kROWS:
      case kPOSITIONS: return d.type == DataType::kINT64;
      default: return d.type == inOut[kKV].desc.type;  // k_norm, cache, output
    }
  }

  int32_t configurePlugin(DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* out,
                          int32_t nbOutputs) noexcept override {
    if (nbInputs != kNB_INPUTS || nbOutputs != 1) return fail_io_count(nbInputs, nbOutputs);
    Dims dims[kNB_INPUTS];
    for (int32_t i = 0; i < kNB_INPUTS; ++i) dims[i] = in[i].desc.dims;
    return check(dims, out[0].desc.dims, false);
  }

  // With alias_cache = 1, output 0 aliases input 4 (the cache), which needs TensorRT's preview feature
  // kALIASED_PLUGIN_IO_10_03 on the builder config (TensorRT may still insert copies); else -1, no aliasing declared:
  // the application may still bind the output to the cache's own address, and enqueue then writes in place.
  int32_t getAliasedInput(int32_t outputIndex) noexcept override {
    return outputIndex == 0 && mAliasCache == 1 ? kCACHE : -1;
  }

  // IPluginV3OneRuntime
  int32_t onShapeChange(PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out,
                        int32_t nbOutputs) noexcept override {
    if (nbInputs != kNB_INPUTS || nbOutputs != 1) return fail_io_count(nbInputs, nbOutputs);
    Dims dims[kNB_INPUTS];
    for (int32_t i = 0; i < kNB_INPUTS; ++i) dims[i] = in[i].dims;
    return check(dims, out[0].dims, true);
  }

  int32_t enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc, void const* const* inputs,
                  void* const* outputs, void* /*workspace*/, cudaStream_t stream) noexcept override {
    try {
      return launch(inputDesc, outputDesc, inputs, outputs, stream);
    } catch (...) {  // an error message's allocation
      return -1;
    }
  }

  // A clone that reports to this execution context's error recorder (the copy constructor does not copy one).
  IPluginV3* attachToContext(IPluginResourceContext* context) noexcept override {
    try {
      auto* p = new KVInjectPlugin(*this);
      p->mRecorder = context != nullptr ? context->getErrorRecorder() : nullptr;
      return p;
    } catch (...) {
      return nullptr;
    }
  }

  PluginFieldCollection const* getFieldsToSerialize() noexcept override {
    mField[0] = PluginField("eps", &mEps, PluginFieldType::kFLOAT32, 1);
    mField[1] = PluginField("alias_cache", &mAliasCache, PluginFieldType::kINT32, 1);
    mFields = PluginFieldCollection{2, mField};
    return &mFields;
  }

 private:
  // enqueue: the shapes checked again (nothing is launched for a bad one), the cache copied to the output unless the
  // two share one address, then one kernel launch on `stream` (the guarded entry point: a row or position outside
  // the cache is skipped, not asserted). Returns 0, -1 for a bad shape or copy, or the launch's CUDA error; a bad
  // shape or type is reported as kINVALID_ARGUMENT, a CUDA failure as kFAILED_EXECUTION.
  int32_t launch(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc, void const* const* inputs,
                 void* const* outputs, cudaStream_t stream) const {
    Dims dims[kNB_INPUTS];
    for (int32_t i = 0; i < kNB_INPUTS; ++i) dims[i] = inputDesc[i].dims;
    if (check(dims, outputDesc[0].dims, true) != 0) return -1;
    int const dtype = dtype_code(inputDesc[kCACHE].type);
    if (dtype < 0 || outputDesc[0].type != inputDesc[kCACHE].type) {
      report(mRecorder, ErrorCode::kINVALID_ARGUMENT,
             "cache and output must share one of float32 / float16 / bfloat16");
      return -1;
    }
    void* cache = outputs[0];
    if (cache != inputs[kCACHE]) {  // not one buffer: the output starts as a copy of the cache
      size_t const bytes = static_cast<size_t>(volume(dims[kCACHE])) * (dtype == 0 ? 4 : 2);
      cudaError_t const err = cudaMemcpyAsync(cache, inputs[kCACHE], bytes, cudaMemcpyDeviceToDevice, stream);
      if (err != cudaSuccess) {
        report(mRecorder, ErrorCode::kFAILED_EXECUTION,
               std::string("copying the cache to the output failed: ") + cudaGetErrorString(err));
        return -1;
      }
    }
    Dims const& cd = dims[kCACHE];
    int const code = dflash_kv_inject_guarded(
        dtype, inputs[kKV], inputs[kKNORM], mEps, static_cast<float const*>(inputs[kCOS]),
        static_cast<float const*>(inputs[kSIN]), cache, static_cast<int64_t const*>(inputs[kROWS]),
        static_cast<int64_t const*>(inputs[kPOSITIONS]), dims[kPOSITIONS].d[0], dims[kPOSITIONS].d[1], cd.d[1],
        cd.d[2], cd.d[3], cd.d[4], cd.d[5], stream);
    if (code != 0) {  // the arguments were checked above: a CUDA failure (no device, a launch error)
      report(mRecorder, ErrorCode::kFAILED_EXECUTION,
             std::string("dflash_kv_inject_guarded failed: ") + dflash_cuda_error_string(code) + " (cache " +
                 dims_str(cd) + ", positions " + dims_str(dims[kPOSITIONS]) + ")");
      return code;
    }
    return 0;
  }

  int32_t fail_io_count(int32_t nbInputs, int32_t nbOutputs) const noexcept {
    try {
      report(mRecorder, ErrorCode::kINVALID_ARGUMENT,
             "takes 7 inputs (kv, k_norm, cos, sin, cache, rows, positions) and 1 output, got " +
                 std::to_string(nbInputs) + " and " + std::to_string(nbOutputs));
    } catch (...) {
    }
    return -1;
  }

  // 0 if the shapes fit (see check_shapes; `exact` also requires the output to be the cache's shape), else -1
  // with the reason reported.
  int32_t check(Dims const* in, Dims const& out, bool exact) const noexcept {
    try {
      std::string why = check_shapes(in, exact);
      bool same = out.nbDims == in[kCACHE].nbDims;
      for (int32_t i = 0; same && i < out.nbDims; ++i) same = out.d[i] == in[kCACHE].d[i];
      if (why.empty() && exact && !same)
        why = "the output must be the cache's shape " + dims_str(in[kCACHE]) + ", got " + dims_str(out);
      if (why.empty()) return 0;
      report(mRecorder, ErrorCode::kINVALID_ARGUMENT, why);
    } catch (...) {
    }
    return -1;
  }

  float mEps;
  int32_t mAliasCache;  // 0 or 1
  IErrorRecorder* mRecorder{nullptr};
  PluginField mField[2];
  PluginFieldCollection mFields{};
};

class KVInjectCreator final : public IPluginCreatorV3One {
 public:
  KVInjectCreator() {
    mField[0] = PluginField("eps", nullptr, PluginFieldType::kFLOAT32, 1);
    mField[1] = PluginField("alias_cache", nullptr, PluginFieldType::kINT32, 1);
    mFields = PluginFieldCollection{2, mField};
  }

  // eps is required: one finite kFLOAT32 > 0. alias_cache is optional: one kINT32, 0 or 1 (0 when absent). nullptr
  // (with a message naming the field) for a missing, mistyped or out-of-range field, or an unknown one.
  IPluginV3* createPlugin(AsciiChar const* /*name*/, PluginFieldCollection const* fc,
                          TensorRTPhase /*phase*/) noexcept override {
    try {
      bool found = false;
      float eps = 0.0f;
      int32_t alias_cache = 0;
      ErrorCode const bad = ErrorCode::kINVALID_ARGUMENT;
      for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i) {
        PluginField const& f = fc->fields[i];
        std::string const name = f.name != nullptr ? f.name : "";
        std::string const got =
            "got type " + std::to_string(static_cast<int32_t>(f.type)) + " with length " + std::to_string(f.length);
        if (name == "eps") {
          if (f.type != PluginFieldType::kFLOAT32 || f.length != 1 || f.data == nullptr) {
            report(nullptr, bad, "field eps must be one kFLOAT32 value (the drafter's rms_norm_eps), " + got);
            return nullptr;
          }
          eps = *static_cast<float const*>(f.data);
          found = true;
        } else if (name == "alias_cache") {
          if (f.type != PluginFieldType::kINT32 || f.length != 1 || f.data == nullptr) {
            report(nullptr, bad, "field alias_cache must be one kINT32 value (0 or 1), " + got);
            return nullptr;
          }
          alias_cache = *static_cast<int32_t const*>(f.data);
          if (alias_cache != 0 && alias_cache != 1) {
            report(nullptr, bad, "field alias_cache must be 0 or 1, got " + std::to_string(alias_cache));
            return nullptr;
          }
        } else {
          report(nullptr, bad,
                 "unknown field '" + name + "'; the fields are eps (kFLOAT32) and alias_cache (kINT32, optional)");
          return nullptr;
        }
      }
      if (!found) {
        report(nullptr, bad, "missing field eps (kFLOAT32): k_norm's epsilon, the drafter config's rms_norm_eps");
        return nullptr;
      }
      if (!std::isfinite(eps) || eps <= 0.0f) {
        report(nullptr, bad, "eps must be finite and > 0, got " + std::to_string(eps));
        return nullptr;
      }
      return new KVInjectPlugin(eps, alias_cache);
    } catch (...) {
      return nullptr;
    }
  }

  PluginFieldCollection const* getFieldNames() noexcept override { return &mFields; }
  AsciiChar const* getPluginName() const noexcept override { return kNAME; }
  AsciiChar const* getPluginVersion() const noexcept override { return kVERSION; }
  AsciiChar const* getPluginNamespace() const noexcept override { return kNAMESPACE; }

 private:
  PluginField mField[2];
  PluginFieldCollection mFields{};
};

}  // namespace

// The entry points IPluginRegistry::loadLibrary (and trtexec --dynamicPlugins) look up in a plugin library.
extern "C" {

DFLASH_EXPORT void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept { gLoggerFinder.store(finder); }

DFLASH_EXPORT nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators) noexcept {
  static KVInjectCreator creator;
  static nvinfer1::IPluginCreatorInterface* const creators[] = {&creator};
  nbCreators = 1;
  return creators;
}

}  // extern "C"
