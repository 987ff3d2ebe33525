// SPDX-License-Identifier: Apache-2.0
// kvx_cpu_driver: runs the kernels' C entry points (kvx_topk_gather, kvx_latent_attention) on the CPU shim for the
// cases listed in a job file, one per line (tests/plugins/cpu_kernels.py writes them):
//
//   device sms=N optin=BYTES cc=MAJOR.MINOR          emulated GPU for the following cases
//   topk DIR DTYPE B H S Dk Dv k                     DIR/{scores,keys,values,positions}.bin -> kept_*.bin
//   latent DIR DTYPE B H T S D R SCALE               DIR/{q,latent,q_positions,latent_positions}.bin -> out.bin
//   latent2 DIR DTYPE FORMAT NEW B H T S D R SCALE   op version 2 (kvx_latent_attention_v2): FORMAT 0 / 1 / 2 (latent
//                                                    uint8 codes + DIR/latent_scale.bin (B, S) fp16 when FORMAT != 0;
//                                                    no file: a null scale pointer),
//                                                    NEW 1: DIR/new_latent.bin (B, T, D) attended after the cache
//   plan DIR DTYPE B H T S D R                       DIR/plan: the launch plan only (path, tile, splits, bytes)
//
// DTYPE is the KvxDType code (0 fp32, 1 fp16, 2 bf16) of keys/values or q/latent. Every output and workspace buffer
// is its own allocation (AddressSanitizer sees overruns) filled with 0xFF first, so an element the kernels do not
// write reads as NaN / -1. Each case writes DIR/status (the cudaError_t code).
#include "../../../plugins/common/kvxDevice.h"
#include "../../../plugins/latent_attention/latentAttentionKernel.h"
#include "../../../plugins/topk_gather/topKGatherKernel.h"

#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace
{

std::vector<unsigned char> readFile(std::string const& path, size_t expect)
{
    std::ifstream f(path, std::ios::binary);
    if (!f)
    {
        kvxshim::fatal("driver: cannot read %s", path.c_str());
    }
    std::vector<unsigned char> data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (data.size() != expect)
    {
        kvxshim::fatal("driver: %s has %zu bytes, expected %zu", path.c_str(), data.size(), expect);
    }
    return data;
}

void writeFile(std::string const& path, void const* data, size_t bytes)
{
    std::ofstream f(path, std::ios::binary);
    f.write(static_cast<char const*>(data), static_cast<std::streamsize>(bytes));
}

//! An exactly sized heap block (nullptr for 0 bytes), optionally filled from a file or with 0xFF.
struct DeviceBuffer
{
    unsigned char* p = nullptr;
    size_t n = 0;
    explicit DeviceBuffer(size_t bytes)
        : n(bytes)
    {
        if (bytes > 0)
        {
            p = static_cast<unsigned char*>(std::malloc(bytes));
            std::memset(p, 0xFF, bytes);
        }
    }
    DeviceBuffer(std::string const& path, size_t bytes)
        : DeviceBuffer(bytes)
    {
        std::vector<unsigned char> const d = readFile(path, bytes);
        if (bytes > 0)
        {
            std::memcpy(p, d.data(), bytes);
        }
    }
    ~DeviceBuffer()
    {
        std::free(p);
    }
    DeviceBuffer(DeviceBuffer const&) = delete;
    DeviceBuffer& operator=(DeviceBuffer const&) = delete;
};

size_t elemSize(int dtype)
{
    return dtype == 0 ? 4 : dtype == 3 ? 1 : 2; // KvxDType: fp32, fp16 / bf16, uint8 codes
}

void status(std::string const& dir, int rc)
{
    std::ofstream(dir + "/status") << rc << "\n";
}

void runTopK(std::istringstream& in)
{
    std::string dir;
    int dtype, B, H, S, Dk, Dv, k;
    in >> dir >> dtype >> B >> H >> S >> Dk >> Dv >> k;
    size_t const es = elemSize(dtype);
    size_t const rows = static_cast<size_t>(B) * H;
    DeviceBuffer scores(dir + "/scores.bin", rows * S * 4);
    DeviceBuffer keys(dir + "/keys.bin", rows * S * Dk * es);
    DeviceBuffer values(dir + "/values.bin", rows * S * Dv * es);
    DeviceBuffer positions(dir + "/positions.bin", rows * S * 8);
    DeviceBuffer keptKeys(rows * k * Dk * es);
    DeviceBuffer keptValues(rows * k * Dv * es);
    DeviceBuffer keptPositions(rows * k * 8);
    DeviceBuffer keptIndices(rows * k * 8);
    size_t const wsBytes = kvx_topk_gather_workspace_size(B, H, S);
    DeviceBuffer ws(wsBytes);
    int const rc = kvx_topk_gather(dtype, reinterpret_cast<float const*>(scores.p), keys.p, values.p,
        reinterpret_cast<int64_t const*>(positions.p), B, H, S, Dk, Dv, k, keptKeys.p, keptValues.p,
        reinterpret_cast<int64_t*>(keptPositions.p), reinterpret_cast<int64_t*>(keptIndices.p), ws.p, wsBytes,
        nullptr);
    writeFile(dir + "/kept_keys.bin", keptKeys.p, keptKeys.n);
    writeFile(dir + "/kept_values.bin", keptValues.p, keptValues.n);
    writeFile(dir + "/kept_positions.bin", keptPositions.p, keptPositions.n);
    writeFile(dir + "/kept_indices.bin", keptIndices.p, keptIndices.n);
    status(dir, rc);
}

void runLatent(std::istringstream& in)
{
    std::string dir;
    int dtype, B, H, T, S, D, R;
    float scale;
    in >> dir >> dtype >> B >> H >> T >> S >> D >> R >> scale;
    size_t const es = elemSize(dtype);
    DeviceBuffer q(dir + "/q.bin", static_cast<size_t>(B) * H * T * D * es);
    DeviceBuffer latent(dir + "/latent.bin", static_cast<size_t>(B) * S * D * es);
    DeviceBuffer qPos(dir + "/q_positions.bin", static_cast<size_t>(B) * T * 8);
    DeviceBuffer lPos(dir + "/latent_positions.bin", static_cast<size_t>(B) * S * 8);
    DeviceBuffer out(static_cast<size_t>(B) * H * T * R * es);
    KvxDeviceInfo dev{};
    int rc = kvx_query_device(&dev);
    if (rc == 0)
    {
        int32_t plan[6] = {};
        double bytes[3] = {};
        kvx_latent_attention_plan(dtype, B, H, T, S, D, R, &dev, plan, bytes);
        std::ofstream(dir + "/plan") << plan[0] << " " << plan[1] << " " << plan[2] << " " << plan[3] << " " << plan[4]
                                     << " " << plan[5] << " " << bytes[0] << " " << bytes[1] << "\n";
        size_t const wsBytes = kvx_latent_attention_workspace_size(B, H, T, S, D, R);
        DeviceBuffer ws(wsBytes);
        rc = kvx_latent_attention(dtype, q.p, latent.p, reinterpret_cast<int64_t const*>(qPos.p),
            reinterpret_cast<int64_t const*>(lPos.p), B, H, T, S, D, R, scale, out.p, ws.p, wsBytes, &dev, nullptr);
    }
    writeFile(dir + "/out.bin", out.p, out.n);
    status(dir, rc);
}

void runLatentV2(std::istringstream& in)
{
    std::string dir;
    int dtype, format, hasNew, B, H, T, S, D, R;
    float scale;
    in >> dir >> dtype >> format >> hasNew >> B >> H >> T >> S >> D >> R >> scale;
    size_t const es = elemSize(dtype);
    size_t const latEs = format != 0 ? 1 : es;
    DeviceBuffer q(dir + "/q.bin", static_cast<size_t>(B) * H * T * D * es);
    DeviceBuffer latent(dir + "/latent.bin", static_cast<size_t>(B) * S * D * latEs);
    bool const hasScale = format != 0 && std::ifstream(dir + "/latent_scale.bin").good(); // absent: null scales
    DeviceBuffer latScale = hasScale ? DeviceBuffer(dir + "/latent_scale.bin", static_cast<size_t>(B) * S * 2)
                                     : DeviceBuffer(0);
    DeviceBuffer newLatent = hasNew ? DeviceBuffer(dir + "/new_latent.bin", static_cast<size_t>(B) * T * D * es)
                                    : DeviceBuffer(0);
    DeviceBuffer qPos(dir + "/q_positions.bin", static_cast<size_t>(B) * T * 8);
    DeviceBuffer lPos(dir + "/latent_positions.bin", static_cast<size_t>(B) * S * 8);
    DeviceBuffer out(static_cast<size_t>(B) * H * T * R * es);
    KvxDeviceInfo dev{};
    int rc = kvx_query_device(&dev);
    if (rc == 0)
    {
        kvexport::LatentAttentionParams p{dtype, q.p, latent.p, reinterpret_cast<int64_t const*>(qPos.p),
            reinterpret_cast<int64_t const*>(lPos.p), B, H, T, S, D, R, scale, out.p, nullptr, 0, format, latScale.p,
            newLatent.p};
        kvexport::LatentAttentionPlan const plan = kvexport::planLatentAttention(p, dev);
        std::ofstream(dir + "/plan") << static_cast<int>(plan.path) << " " << plan.rowsPerBlock << " "
                                     << plan.tileSlots << " " << plan.threads << " " << plan.splits << " "
                                     << plan.smemBytes << " " << plan.latentBytes << " " << plan.partialBytes << "\n";
        size_t const wsBytes = kvx_latent_attention_workspace_size(B, H, T, S + (hasNew ? T : 0), D, R);
        DeviceBuffer ws(wsBytes);
        rc = kvx_latent_attention_v2(dtype, format, q.p, latent.p, latScale.p, newLatent.p,
            reinterpret_cast<int64_t const*>(qPos.p), reinterpret_cast<int64_t const*>(lPos.p), B, H, T, S, D, R,
            scale, out.p, ws.p, wsBytes, &dev, nullptr);
    }
    writeFile(dir + "/out.bin", out.p, out.n);
    status(dir, rc);
}

void planLatent(std::istringstream& in)
{
    std::string dir;
    int dtype, B, H, T, S, D, R;
    in >> dir >> dtype >> B >> H >> T >> S >> D >> R;
    KvxDeviceInfo dev{};
    int rc = kvx_query_device(&dev);
    int32_t plan[6] = {};
    double bytes[3] = {};
    if (rc == 0)
    {
        rc = kvx_latent_attention_plan(dtype, B, H, T, S, D, R, &dev, plan, bytes);
    }
    std::ofstream(dir + "/plan") << plan[0] << " " << plan[1] << " " << plan[2] << " " << plan[3] << " " << plan[4]
                                 << " " << plan[5] << " " << bytes[0] << " " << bytes[1] << "\n";
    status(dir, rc);
}

void setDevice(std::istringstream& in)
{
    std::string tok;
    kvxshim::DeviceConfig& c = kvxshim::config();
    while (in >> tok)
    {
        auto const eq = tok.find('=');
        std::string const key = tok.substr(0, eq);
        std::string const val = tok.substr(eq + 1);
        if (key == "sms")
        {
            c.smCount = std::stoi(val);
        }
        else if (key == "optin")
        {
            c.smemPerBlockOptin = std::stoi(val);
            c.smemPerSM = c.smemPerBlockOptin + 1024;
        }
        else if (key == "cc")
        {
            c.ccMajor = std::stoi(val.substr(0, val.find('.')));
            c.ccMinor = std::stoi(val.substr(val.find('.') + 1));
        }
        else
        {
            kvxshim::fatal("driver: unknown device option %s", tok.c_str());
        }
    }
}

} // namespace

int main(int argc, char** argv)
{
    if (argc != 2)
    {
        std::fprintf(stderr, "usage: %s JOBFILE\n", argv[0]);
        return 2;
    }
    std::ifstream jobs(argv[1]);
    if (!jobs)
    {
        std::fprintf(stderr, "cannot read %s\n", argv[1]);
        return 2;
    }
    std::string line;
    int n = 0;
    while (std::getline(jobs, line))
    {
        std::istringstream in(line);
        std::string op;
        if (!(in >> op) || op[0] == '#')
        {
            continue;
        }
        if (op == "device")
        {
            setDevice(in);
        }
        else if (op == "topk")
        {
            runTopK(in);
            ++n;
        }
        else if (op == "latent")
        {
            runLatent(in);
            ++n;
        }
        else if (op == "latent2")
        {
            runLatentV2(in);
            ++n;
        }
        else if (op == "plan")
        {
            planLatent(in);
        }
        else
        {
            kvxshim::fatal("driver: unknown job %s", op.c_str());
        }
    }
    std::printf("%d cases\n", n);
    return 0;
}
