/**
 *  @file   av.c
 *  @brief  Audio and video through FFmpeg's libraries: refused by name until they are built in.
 */
#include "media.h"

uform_status_t uform_audio_chunks(uint8_t const* bytes, size_t length, uint32_t sample_rate, uint32_t chunk_samples,
                                  size_t max_tokens, float* chunks, uform_media_grid_t* grid, char const* field,
                                  char const** error) {
    (void)sample_rate, (void)chunk_samples, (void)max_tokens, (void)chunks, (void)grid;
    return uform_media_refuse_missing(uform_media_sniff(bytes, length), field, error);
}

uform_status_t uform_video_tubelets(uint8_t const* bytes, size_t length, uint32_t patch_side, uint32_t tube_frames,
                                    uint32_t frame_stride, uint32_t channels, size_t max_tokens, float* tubelets,
                                    uform_media_grid_t* grid, char const* field, char const** error) {
    (void)patch_side, (void)tube_frames, (void)frame_stride, (void)channels, (void)max_tokens, (void)tubelets, (void)grid;
    return uform_media_refuse_missing(uform_media_sniff(bytes, length), field, error);
}
